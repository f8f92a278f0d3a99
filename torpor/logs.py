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
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]
FIELDS = ("session_id", "correlation_id", "trace_id")
_CONTEXT: ContextVar[dict[str, str]] = ContextVar("torpor_log_context", default={})  # noqa: B039 - never mutated, replaced
_HANDLER_NAME = "torpor-json"
LOGGERS = ("torpor", "actors", "storage")


@contextmanager
def bind(**fields: str | None) -> Iterator[None]:
    """Attribute every line logged inside to these ids (``None`` values are left out)."""
    token = _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


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
