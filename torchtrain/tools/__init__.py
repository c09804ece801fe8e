"""User-facing command-line tools (loss parity, ...)."""
