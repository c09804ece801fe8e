"""Offline data tools: `python -m torchtrain.data.prepare` (raw text -> token shards, docs/data.md)."""
