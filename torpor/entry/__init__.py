"""User-facing entry points that need the whole stack: the demo runner."""
