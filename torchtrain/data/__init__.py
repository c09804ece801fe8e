"""Data: raw text -> prepared token shards (format.py, readers.py, prepare.py) -> windows chosen by
global sample index (sampling.py, dataset.py) -> a stateful, data-parallel loader (loader.py), with
the built-in text datasets prepared once into a cache (sources.py, cache.py). See docs/data.md.

Import the submodules directly: this package imports nothing, so the offline preparation tool
starts without loading torch."""
