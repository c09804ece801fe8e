"""Small shared helpers (logging)."""
