"""Prepare once, offline: raw text -> token shards (docs/data.md).

    python -m torchtrain.data.prepare INPUT [INPUT ...] --out DIR [--workers N] [--tokenizer PATH]

The inputs (files, folders, globs of .txt / .jsonl[.gz|.zst] / .parquet) are cut into pieces
(`readers.py`), and consecutive pieces are grouped into units of about `--shard-size-mb` input
megabytes; unit i becomes shard i. The plan depends only on the inputs and the options, so the
output is byte-identical for any worker count. Workers tokenize units in parallel; each shard is
written atomically (`format.ShardWriter`), so a re-run skips finished shards and a killed run never
leaves a shard, or a manifest, that reads as complete. The manifest is written last, and only when
the run passes the keep-or-fail rule for bad input (`bad_input.py`). Replacing a dataset
(`--overwrite`) prepares the new one beside it, in `<out>/.overwrite`, and swaps it in only once it
is complete and good: a failed or killed run leaves the old dataset as it was.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from torchtrain.data.bad_input import PrepareError, bad_records, check_bad_input
from torchtrain.data.format import (
    FORMAT,
    MANIFEST,
    PROBLEMS,
    VERSION,
    ShardWriter,
    read_json,
    shard_is_complete,
    shard_name,
    token_dtype,
)
from torchtrain.data.readers import Piece, Problem, Unreadable, discover, documents, pieces_of
from torchtrain.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from torchtrain.utils.atomic_file import write_json_atomic
from torchtrain.utils.progress import Progress, human

MAX_PROBLEM_DETAILS = 10_000  # per shard; the counts are always exact
STAGING = ".overwrite"  # where --overwrite prepares the replacement of a dataset, inside the output folder


@dataclass(frozen=True)
class Options:
    text_field: str = "text"
    """The document field of .jsonl records and the column of .parquet files."""
    shard_bytes: int = 256 << 20
    """Input bytes per shard (about): the unit of parallel work and of resuming."""
    strict: bool = False
    """Stop at the first bad record instead of reporting, counting and skipping it."""
    max_bad_fraction: float = 0.01
    """The largest share of input records that may be dropped as bad (docs/data.md) for the run to
    write a dataset; a run that keeps no document fails whatever this is."""


def plan_units(pieces: list[Piece], shard_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces grouped into units of >= shard_bytes input bytes (the last may be smaller)."""
    units: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        current.append(piece)
        size += (piece.end - piece.start) if piece.kind == "jsonl" and piece.end >= 0 else piece.size
        if size >= shard_bytes:
            units.append(current)
            current, size = [], 0
    if current:
        units.append(current)
    return units


def _unit_bytes(unit: list[Piece]) -> int:
    return sum((p.end - p.start) if p.kind == "jsonl" and p.end >= 0 else p.size for p in unit)


def _encoder(tok: Tokenizer) -> Callable[[str], np.ndarray]:
    if isinstance(tok, ByteTokenizer):  # the bytes are the tokens: no Python list on the way
        head, tail = np.array([tok.bos_id]), np.array([tok.eos_id])
        return lambda text: np.concatenate([head, np.frombuffer(text.encode("utf-8"), np.uint8), tail])
    return lambda text: np.asarray(tok.encode(text, bos=True, eos=True), dtype=np.int64)


# ------------------------------------------------------------------------------------------- worker
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_path: str | None, tokens_done, bytes_done, pool: bool = True) -> None:
    if pool:  # one thread per worker: parallelism comes from the workers
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER.update(tokenizer=build_tokenizer(tokenizer_path, "--tokenizer"), tokens=tokens_done, bytes=bytes_done)


def _prepare_unit(job: tuple[int, list[Piece], str, str, Options, dict]) -> dict[str, Any]:
    index, unit, folder, dtype, options, identity = job
    encode = _encoder(_WORKER["tokenizer"])
    writer = ShardWriter(folder, index, dtype)
    problems: list[Problem] = []
    per_piece = []
    pending = 0
    try:
        for piece in unit:
            mark = writer.mark()
            docs0, counted = writer.documents, writer.tokens
            try:
                for text in documents(piece, options.text_field, problems):
                    if options.strict and problems:
                        break
                    writer.add(encode(text))
                    pending += 1
                    if pending == 256:
                        _add(_WORKER["tokens"], writer.tokens - counted)
                        counted, pending = writer.tokens, 0
            except Unreadable as e:  # a file that breaks off: none of it is kept, all of it counts as bad
                e.problem.records += writer.documents - docs0
                writer.rollback(mark)
                problems.append(e.problem)
            _add(_WORKER["tokens"], writer.tokens - counted)
            _add(_WORKER["bytes"], _unit_bytes([piece]))
            if options.strict and problems:
                raise PrepareError(f"{problems[0]} (--strict: stopped at the first bad record)")
            per_piece.append({**piece.describe(), "documents": writer.documents - docs0})
        return writer.close({"pieces": per_piece, "tokenizer": identity, "text_field": options.text_field,
                             "problem_count": len(problems), "bad_records": sum(p.records for p in problems),
                             "problems": [[p.path, p.line, p.reason, p.records]
                                          for p in problems[:MAX_PROBLEM_DETAILS]]})
    except BaseException:
        writer.abort()
        raise


def _add(counter, n: int) -> None:
    if counter is not None and n:
        with counter.get_lock():
            counter.value += n


# ------------------------------------------------------------------------------------------- driver
def _plan_digest(units: list[list[Piece]], identity: dict, options: Options, dtype: str) -> str:
    plan = {"units": [[p.describe() for p in u] for u in units], "tokenizer": identity,
            "text_field": options.text_field, "dtype": dtype}
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def _reusable(folder: str, index: int, unit: list[Piece], identity: dict, options: Options, dtype: str):
    record = read_json(os.path.join(folder, f"{shard_name(index)}.json"))
    if (record is None or record.get("tokenizer") != identity or record.get("text_field") != options.text_field
            or [{k: v for k, v in p.items() if k != "documents"} for p in record.get("pieces", [])]
            != [p.describe() for p in unit]):
        return None
    return record if shard_is_complete(folder, record, dtype) else None


def prepare(pieces: list[Piece], out: str, tokenizer_path: str | None = None, options: Options = Options(),
            workers: int = 1, overwrite: bool = False, log: Callable[[str], None] = print,
            show_progress: bool = True, tokenizer_key: str = "--tokenizer", text_field_key: str = "--text-field",
            allow_more: str = "allow more with --max-bad-fraction (a re-run reuses the finished shards)"
            ) -> dict[str, Any]:
    """Tokenize `pieces` into a prepared dataset at `out`; returns its manifest (module docstring).
    PrepareError when the input gives no dataset (`bad_input.py`); the keys name the caller's settings
    in that message."""
    tokenizer = build_tokenizer(tokenizer_path, tokenizer_key)
    identity = tokenizer.identity
    dtype = token_dtype(tokenizer.vocab_size)
    units = plan_units(pieces, options.shard_bytes)
    digest = _plan_digest(units, identity, options, dtype)
    work = _work_folder(out, digest, overwrite, log)
    if isinstance(work, dict):  # already prepared
        return work
    records: list[dict | None] = [_reusable(work, i, u, identity, options, dtype) for i, u in enumerate(units)]
    todo = [i for i, r in enumerate(records) if r is None]
    total_bytes = sum(_unit_bytes(u) for u in units)
    if len(todo) < len(units):
        log(f"resuming: {len(units) - len(todo)} of {len(units)} shards already prepared")
    workers = max(1, min(workers, len(todo)))
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    tokens_done, bytes_done = ctx.Value("q", 0), ctx.Value("q", 0)
    bar = Progress("prepare", total=sum(_unit_bytes(units[i]) for i in todo) / 1e6, unit="MB",
                   enabled=show_progress)
    jobs = [(i, units[i], work, dtype, options, identity) for i in todo]

    def tick() -> None:
        bar.postfix = f"{human(tokens_done.value / max(bar.elapsed, 1e-9))} tokens/s"
        bar.update(bytes_done.value / 1e6 - bar.done)

    if workers == 1:
        _init_worker(tokenizer_path, tokens_done, bytes_done, pool=False)
        for job in jobs:
            records[job[0]] = _prepare_unit(job)
            tick()
    else:
        with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path, tokens_done, bytes_done)) as pool:
            result = pool.map_async(_prepare_unit, jobs, chunksize=1)
            while not result.ready():
                result.wait(0.5)
                tick()
            for job, record in zip(jobs, result.get()):
                records[job[0]] = record
    bar.postfix = f"{human(tokens_done.value / max(bar.elapsed, 1e-9))} tokens/s"
    bar.done = bytes_done.value / 1e6
    bar.close()
    done = [r for r in records if r is not None]
    _write_problems(work, done)
    check_bad_input(done, options.max_bad_fraction, os.path.join(work, PROBLEMS), options.text_field, text_field_key,
                    allow_more, any(p.kind != "text" for p in pieces))
    manifest = _manifest(work, len(units), done, identity, dtype, digest, options.text_field)
    if work != out:
        _promote(work, out)
    _summary(manifest, out, time.monotonic() - t0, sum(records[i]["tokens"] for i in todo), total_bytes,
             options.max_bad_fraction, log)
    return manifest


def _work_folder(out: str, digest: str, overwrite: bool, log: Callable[[str], None]) -> str | dict[str, Any]:
    """Where to prepare: `out`, or beside the dataset it holds when replacing it (--overwrite); the
    existing manifest when `out` already holds this very plan."""
    os.makedirs(out, exist_ok=True)
    staging = os.path.join(out, STAGING)
    if read_json(os.path.join(staging, MANIFEST)) is not None and read_json(os.path.join(out, MANIFEST)) is None:
        _promote(staging, out)  # a replacement that was killed while being swapped in: finish the swap
    existing = read_json(os.path.join(out, MANIFEST))
    if existing is not None and not (isinstance(existing, dict) and existing.get("num_tokens")):
        os.remove(os.path.join(out, MANIFEST))  # a manifest of nothing (older releases wrote one): not a dataset
        existing = None
    if existing is None:
        shutil.rmtree(staging, ignore_errors=True)  # an abandoned replacement of a dataset that is gone
        return out
    if existing.get("plan_sha256") == digest:
        log(f"{out} is already prepared from these inputs ({human(existing['num_tokens'])} tokens): nothing to do")
        return existing
    if not overwrite:
        raise PrepareError(f"{out} already holds a prepared dataset made from other inputs or options; choose "
                           f"another --out, or pass --overwrite to replace it")
    log(f"{out} keeps its current dataset until the new one is complete and passes the bad-input check "
        f"(preparing in {staging})")
    os.makedirs(staging, exist_ok=True)
    return staging


def _promote(staging: str, out: str) -> None:
    """Swap the complete dataset in `staging` into `out`, manifest last: a kill on the way leaves `out`
    without a manifest (not a dataset) and `staging` with its own, and the next run finishes the swap."""
    if os.path.exists(os.path.join(out, MANIFEST)):
        os.remove(os.path.join(out, MANIFEST))
    keep = {PROBLEMS} | {f"{s['name']}.{kind}" for s in read_json(os.path.join(staging, MANIFEST))["shards"]
                         for kind in ("bin", "idx", "json", "mask")}
    for name in os.listdir(out):  # the replaced dataset's shards that the new one does not overwrite
        if name.startswith("shard-") and name not in keep:
            os.remove(os.path.join(out, name))
    for name in sorted(os.listdir(staging)):
        if name in keep:
            os.replace(os.path.join(staging, name), os.path.join(out, name))
    os.replace(os.path.join(staging, MANIFEST), os.path.join(out, MANIFEST))
    shutil.rmtree(staging, ignore_errors=True)


def _write_problems(folder: str, records: list[dict]) -> None:
    with open(os.path.join(folder, PROBLEMS + ".tmp"), "w") as f:
        for record in records:
            for path, line, reason, *count in record["problems"]:
                f.write(json.dumps({"path": path, "line": line, "reason": reason, "records": (count or [1])[0]}) + "\n")
    os.replace(os.path.join(folder, PROBLEMS + ".tmp"), os.path.join(folder, PROBLEMS))


def _manifest(out: str, num_shards: int, records: list[dict], identity: dict, dtype: str, digest: str,
              text_field: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    sources: dict[str, dict[str, int]] = {}
    for record in records:
        for p in record["pieces"]:
            entry = sources.setdefault(p["path"], {"bytes": p["size"], "documents": 0})
            entry["documents"] += p["documents"]
    for name in os.listdir(out):  # shards of an earlier, longer plan (--overwrite)
        stem = name.split(".")[0]
        if stem.startswith("shard-") and stem[6:].isdigit() and int(stem[6:]) >= num_shards:
            os.remove(os.path.join(out, name))
    manifest = {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "tokenizer": identity, "plan_sha256": digest,
        "text_field": text_field,
        "num_tokens": sum(r["tokens"] for r in records), "num_documents": sum(r["documents"] for r in records),
        "shards": [{k: r[k] for k in ("name", "tokens", "documents", "sha256")} for r in records],
        "sources": [{"path": path, **info} for path, info in sources.items()],
        "problems": sum(r["problem_count"] for r in records), "bad_records": sum(bad_records(r) for r in records),
        **(extra or {}),
    }
    write_json_atomic(os.path.join(out, MANIFEST), manifest, indent=1)
    return manifest


def _summary(manifest: dict, out: str, seconds: float, new_tokens: int, total_bytes: int, max_bad_fraction: float,
             log: Callable[[str], None]) -> None:
    log(f"prepared {out}: {manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens "
        f"({manifest['dtype']}) in {len(manifest['shards'])} shard(s) from {len(manifest['sources'])} file(s) "
        f"({human(total_bytes)}B); {seconds:.1f}s, {human(new_tokens / max(seconds, 1e-9))} tokens/s")
    if manifest["problems"]:
        shown = []
        with open(os.path.join(out, PROBLEMS)) as f:
            for line, _ in zip(f, range(10)):
                p = json.loads(line)
                shown.append(f"  {p['path']}{':' + str(p['line']) if p['line'] else ''}: {p['reason']}")
        bad, total = manifest["bad_records"], manifest["bad_records"] + manifest["num_documents"]
        log(f"{manifest['problems']:,} bad or empty inputs skipped (all listed in {os.path.join(out, PROBLEMS)}); "
            f"{bad:,} of {total:,} input records dropped ({bad / total:.2%}, allowed {max_bad_fraction:g}):\n"
            + "\n".join(shown))


def write_documents(docs: Iterable[str | list[int]], out: str, tokenizer_path: str | None, label: str,
                    tokenizer_key: str = "--tokenizer") -> dict[str, Any]:
    """A one-shard dataset from in-memory documents: text (tokenized) or token ids (BOS/EOS added)."""
    tokenizer = build_tokenizer(tokenizer_path, tokenizer_key)
    identity, dtype = tokenizer.identity, token_dtype(tokenizer.vocab_size)
    encode = _encoder(tokenizer)
    head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    os.makedirs(out, exist_ok=True)
    writer = ShardWriter(out, 0, dtype)
    try:
        for doc in docs:
            writer.add(encode(doc) if isinstance(doc, str) else np.asarray(head + list(doc) + [tokenizer.eos_id]))
        if not writer.documents:
            raise PrepareError(f"no documents: the {label} source gave none; no dataset was written")
    except BaseException:
        writer.abort()
        raise
    record = writer.close({"pieces": [{"path": label, "size": 0, "documents": writer.documents}], "tokenizer": identity,
                           "text_field": "", "problem_count": 0, "problems": []})
    digest = hashlib.sha256(json.dumps([label, identity], sort_keys=True).encode()).hexdigest()
    _write_problems(out, [record])
    return _manifest(out, 1, [record], identity, dtype, digest, "")


def prepare_files(inputs: Iterable[str], out: str, **kwargs) -> dict[str, Any]:
    """`prepare` for files, folders and globs (each expanded as `readers.discover` says)."""
    options: Options = kwargs.get("options", Options())
    pieces = [p for f in discover(list(inputs)) for p in pieces_of(f, options.shard_bytes)]
    return prepare(pieces, out, **kwargs)
