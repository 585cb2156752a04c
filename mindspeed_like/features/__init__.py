"""Feature declarations and the registry of built-in features."""
