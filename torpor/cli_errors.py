"""How the ``torpor`` command fails (``torpor.cli``): its exit codes, documented in
:data:`EXIT_CODES`, the errors that carry them, and stdout's reader gone."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_CONFIG = 4
EXIT_INTERNAL = 5
EXIT_INTERRUPTED = 130


# The documented exit codes (README "Exit codes"; a test keeps the two in step).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_FAILED: "the command failed: the API refused it (its problem detail is printed), "
    "or a signed `send` got a non-2xx answer",
    EXIT_USAGE: "bad command line (unknown command, missing argument)",
    EXIT_UNREACHABLE: "torpor's API, Ray or another service could not be reached",
    EXIT_CONFIG: "the configuration (TORPOR_CONFIG, TORPOR_* variables) is invalid",
    EXIT_INTERNAL: "an unexpected error (a bug: the line names the exception)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class CliError(Exception):
    """A failure worth one line to the user; ``code`` is its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class Unreachable(CliError):
    """A service the command needs did not answer."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_UNREACHABLE)


class OutputClosed(Exception):
    """The reader of stdout went away (``torpor ls | head``). Not an ``OSError``: as a
    BrokenPipeError it was caught as an unreachable API, or escaped as a bug."""
