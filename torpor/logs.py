"""torpor's log lines: plain text for a terminal (the default), or one JSON object a line.

The JSON form carries the session id, correlation id and trace id of the work the line
belongs to. They come from the log call's ``extra`` or, failing that, from the context
the session core and the webhook gateway bind around their work (:func:`bind`), so a
line logged deep inside a tool call is still attributed. Only torpor's own loggers
(``torpor.*``, ``actors.*``, ``storage.*``) are formatted; Ray's lines are left as Ray
writes them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]
FIELDS = ("session_id", "correlation_id", "trace_id")
_CONTEXT: ContextVar[dict[str, str]] = ContextVar("torpor_log_context", default={})  # noqa: B039 - never mutated, replaced
_HANDLER_NAME = "torpor-json"
LOGGERS = ("torpor", "actors", "storage")


class bind:  # lower case: used as the function it was, ``with logs.bind(...)``
    """Attribute every line logged inside to these ids (``None`` values are left out).
    A class, not a generator: one a webhook, some 70 interpreted instructions fewer."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: str | None) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        added = {k: v for k, v in self._fields.items() if v}
        self._token = _CONTEXT.set({**_CONTEXT.get(), **added})

    def __exit__(self, *_: object) -> None:
        _CONTEXT.reset(self._token)


def update(**fields: str | None) -> None:
    """Add ids to the innermost :func:`bind` (undone when it exits)."""
    _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v}})


def current() -> dict[str, str]:
    return dict(_CONTEXT.get())


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the bound ids, any error."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        bound = _CONTEXT.get()
        for name in FIELDS:
            value = getattr(record, name, None) or bound.get(name)
            if value:
                line[name] = str(value)
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class Repeated:
    """A failure a loop meets again at every turn for as long as its cause lasts (a
    failing disk under a thread that looks once a second): logged with its traceback the
    first time, then at most once per ``every_s`` with how many went unlogged meanwhile,
    and once when it stops, if it was reported. A cause that comes and goes (fails,
    works, fails) is held to the same pace: a failure after a success is a line only if
    ``every_s`` has passed since the last one. A log that repeats one line 86,400 times
    a day buries the line that says why, and fills the disk that is already failing."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what  # "could not ... in <where>": the start of each line
        self.every_s = every_s
        self.clock = clock
        self.failures = 0  # in a row, since the last success
        self._unlogged = 0  # since the last line
        self._since = 0.0  # when the first of this run of failures came
        self._logged_at = float("-inf")
        self._reported = False  # whether this run of failures has a line

    def failed(self) -> None:
        """One more failure; call it from the ``except`` block (its traceback goes with
        the lines that are logged)."""
        now = self.clock()
        if self.failures == 0:
            self._since = now
        self.failures += 1
        if now - self._logged_at < self.every_s:
            self._unlogged += 1
            return
        again = f" ({self._unlogged} more failures since the last report)" if self._unlogged else ""
        self.logger.warning("%s%s", self.what, again, exc_info=True)
        self._logged_at, self._unlogged, self._reported = now, 0, True

    def succeeded(self) -> None:
        """It worked: said once, if this run of failures was reported."""
        if self.failures == 0:
            return
        if self._reported:
            self.logger.warning(
                "%s: works again after %d %s in %.0f s",
                self.what,
                self.failures,
                "failure" if self.failures == 1 else "failures",
                self.clock() - self._since,
            )
        self.failures, self._reported = 0, False


def configure(fmt: LogFormat, *, stream: TextIO | None = None, level: int = logging.INFO) -> None:
    """Install the JSON handler on torpor's loggers (idempotent), or take it off for
    ``text``, which leaves torpor's lines to the process's usual handlers."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
            logger.removeHandler(old)
        if fmt == "json":
            handler = logging.StreamHandler(stream or sys.stderr)
            handler.set_name(_HANDLER_NAME)
            handler.setFormatter(JsonFormatter())
            logger.addHandler(handler)
            if logger.level == logging.NOTSET or logger.level > level:
                logger.setLevel(level)
            logger.propagate = False  # one line per event, not a second plain copy
        else:
            logger.propagate = True
