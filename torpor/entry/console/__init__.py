"""The operator console: server-rendered pages at ``/console`` (see ``app``)."""

from torpor.entry.console.app import ConsoleDeps, console_app
from torpor.entry.console.mount import ConsoleMount, ConsoleSlot

__all__ = ["ConsoleDeps", "ConsoleMount", "ConsoleSlot", "console_app"]
