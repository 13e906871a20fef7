"""The TUI's widgets, one per module."""
