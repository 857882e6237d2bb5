"""The unified information stream: event bus and its sinks."""
