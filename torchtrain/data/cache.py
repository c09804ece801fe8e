"""The dataset cache: document sources (`python_stdlib`, `files`, `synthetic`, registered ones) are
prepared into token folders once, then read like any prepared dataset.

A source's folder is `<cache>/<label>-<key>`, the key a hash of the source's fingerprint (its files
with sizes and modification times, or its generator's settings) and the tokenizer's identity: a
changed file or another tokenizer gives another folder, never a stale one. Under concurrent starts
(every rank of a job, several jobs) one process prepares while the others wait on a file lock; the
writes themselves are atomic and per-process (`format.py`), so even without working locks (some
network filesystems) the result is correct. A killed preparation resumes at the next start.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torchtrain.data.format import MANIFEST, VERSION, read_json
from torchtrain.data.preparation import Options, prepare, write_documents
from torchtrain.data.sources import FileSource

SHARD_BYTES = 64 << 20  # input bytes per shard of a cached source
# A cached source keeps the default share of bad input (prepare.Options.max_bad_fraction); the way past it:
ALLOW_MORE = ("prepare the files with `python -m torchtrain.data.prepare ... --max-bad-fraction F` and train on the "
              "folder with training.dataset = \"tokens\"")


def cache_root(configured: str | None) -> str:
    """`training.dataset_cache_dir`, else $TORCHTRAIN_CACHE, else $XDG_CACHE_HOME/torchtrain, else
    ~/.cache/torchtrain; datasets go into its `datasets/` folder."""
    root = configured or os.environ.get("TORCHTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torchtrain")
    return os.path.join(root, "datasets")


def _fingerprint(source: Any) -> Any:
    if hasattr(source, "fingerprint"):
        return source.fingerprint()
    h = hashlib.sha256()  # no fingerprint: hash the documents themselves
    for i in range(len(source)):
        h.update(json.dumps(source[i]).encode())
    return {"documents_sha256": h.hexdigest()}


@contextmanager
def _locked(path: str, on_wait: Callable[[], None]) -> Iterator[None]:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_dataset(source: Any, label: str, tokenizer_path: str | None, identity: dict, root: str,
                   log: Callable[[str], None], show_progress: bool, workers: int | None = None) -> str:
    """The prepared folder of `source` (preparing it first if no process has yet)."""
    key = hashlib.sha256(json.dumps({"version": VERSION, "source": _fingerprint(source), "tokenizer": identity},
                                    sort_keys=True, default=str).encode()).hexdigest()[:20]
    folder = os.path.join(root, f"{label}-{key}")
    if read_json(os.path.join(folder, MANIFEST)) is not None:
        return folder
    os.makedirs(root, exist_ok=True)
    with _locked(folder + ".lock", lambda: log(f"waiting: another process is preparing {label} into {folder}")):
        if read_json(os.path.join(folder, MANIFEST)) is None:
            log(f"preparing {label} into the dataset cache {folder} (once; later runs read it directly)")
            if isinstance(source, FileSource):  # files: read by the preparation's own parallel workers
                options = Options(text_field=source.text_field, shard_bytes=SHARD_BYTES)
                prepare(source.pieces(), folder, tokenizer_path, options, workers=workers or min(8, os.cpu_count() or 1),
                        log=log, show_progress=show_progress, tokenizer_key="model.hf_assets_path",
                        text_field_key="training.dataset_text_field", allow_more=ALLOW_MORE)
            else:
                write_documents((source[i] for i in range(len(source))), folder, tokenizer_path, label,
                                tokenizer_key="model.hf_assets_path")
    return folder
