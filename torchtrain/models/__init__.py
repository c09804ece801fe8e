"""Models: the contract tools read (`contract.py`), the shared blocks (`common/`), one folder per family
(`<name>/`, no parallel code but its declared plan) and the registry that loads them (`registry.py`: the
built-in families register on its first lookup)."""
