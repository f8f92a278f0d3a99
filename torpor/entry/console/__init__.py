"""The operator console: server-rendered pages at ``/console`` (see ``app``)."""

from torpor.entry.console.app import ConsoleDeps, ConsoleMount, console_app

__all__ = ["ConsoleDeps", "ConsoleMount", "console_app"]
