"""The operator console: server-rendered pages at ``/console`` (see ``app``)."""

from torpor.entry.console.app import ConsoleDeps, console_app
from torpor.entry.console.mount import ConsoleMount

__all__ = ["ConsoleDeps", "ConsoleMount", "console_app"]
