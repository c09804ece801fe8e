"""Reading raw text for preparation: which files an input names, how they are cut into pieces, and the
documents of a piece, with every bad record reported (file, line, reason) rather than dropped silently.

Formats (by file name; `.gz` via gzip, `.zst` via the `zstandard` package):

* `.txt` (and any file handed over as `text`): the whole file is one document;
* `.jsonl` (and `.json`, read as JSON Lines as Hugging Face's json loader does for c4's files): one JSON
  object per line, the document is its `text_field` string (blank lines are skipped);
* `.parquet`: one document per row of the `text_field` column (the `pyarrow` package);
* `.arrow`: Arrow IPC streams (or files) as Hugging Face `datasets` writes them (`save_to_disk`, its
  cache), one document per row of the `text_field` column (`pyarrow`).

Large uncompressed `.jsonl` files are cut into pieces at line boundaries, and `.parquet` files at row
groups, so that one big file still spreads over many preparation workers; compressed files are read
whole. Piece boundaries depend only on the files and the target size, never on the worker count.

Bad input is reported, never dropped silently: a bad record is a `Problem` (file, line, reason, and
how many input records it drops), and a piece that cannot be read to its end (a truncated or damaged
compressed file, an I/O error) raises `Unreadable`: the reader of the piece drops everything it
had from it (`prepare.py` then applies one keep-or-fail rule to the whole run, docs/data.md).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import sys
import zlib
from dataclasses import asdict, dataclass
from typing import Iterator

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".arrow")
KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSION = (".gz", ".zst")


@dataclass(frozen=True)
class Piece:
    """A part of one input file: bytes [start, end) of a .jsonl (start_line: the line number of its
    first line), row groups [start, end) of a .parquet, or the whole file (end = -1)."""

    path: str
    kind: str  # "text" | "jsonl" | "parquet"
    compression: str  # "" | "gz" | "zst"
    size: int
    mtime_ns: int
    start: int = 0
    end: int = -1
    start_line: int = 1

    def describe(self) -> dict:
        return asdict(self)


@dataclass
class Problem:
    path: str
    line: int  # 1-based line (jsonl), row (parquet); 0 for the whole file
    reason: str
    records: int = 1
    """Input records (lines, rows, files) whose text this drops; 0 when there was no text to keep
    (an empty file or an empty field): those are reported but do not count as bad input."""

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.reason}"


class Unreadable(Exception):
    """A piece that cannot be read to its end; `problem` says where and why."""

    def __init__(self, problem: Problem):
        super().__init__(str(problem))
        self.problem = problem


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged file raises: a truncated gzip stream (EOFError), not gzip or a bad CRC
    and I/O errors (OSError), corrupt deflate data (zlib.error), corrupt zstd data, a damaged parquet
    file (pyarrow's ArrowException). The optional packages only once a reader has imported them."""
    errors: list[type[BaseException]] = [EOFError, OSError, zlib.error]
    if "zstandard" in sys.modules:
        errors.append(sys.modules["zstandard"].ZstdError)
    if "pyarrow" in sys.modules:
        errors.append(sys.modules["pyarrow"].ArrowException)
    return tuple(errors)


def kind_of(path: str) -> tuple[str, str] | None:
    """(kind, compression) from a file name, or None when the file is not a supported input."""
    name, compression = path, ""
    for suffix in COMPRESSION:
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], suffix[1:]
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            kind = KINDS[suffix]
            if kind in ("parquet", "arrow") and compression:
                return None
            return kind, compression
    return None


def discover(inputs: list[str]) -> list[str]:
    """Files named by each input (a file, a folder searched recursively, or a glob), in input order,
    each expanded input sorted; duplicates kept once. Raises ValueError when an input names nothing."""
    files: list[str] = []
    for spec in inputs:
        if any(ch in spec for ch in "*?["):
            found = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f) and kind_of(f))
        elif os.path.isdir(spec):
            found = sorted(f for f in glob.glob(os.path.join(spec, "**", "*"), recursive=True)
                           if os.path.isfile(f) and kind_of(f))
        elif os.path.isfile(spec):
            if kind_of(spec) is None:
                raise ValueError(f"{spec}: unsupported file type (expected .txt, .jsonl, .json, .parquet, .arrow; "
                                 f".txt/.jsonl/.json may end in .gz or .zst)")
            found = [spec]
        else:
            raise ValueError(f"{spec}: no such file, folder or glob match")
        if not found:
            raise ValueError(f"{spec}: holds no .txt, .jsonl, .json, .parquet or .arrow files")
        files += [f for f in found if f not in files]
    return files


def _jsonl_pieces(path: str, size: int, target: int) -> list[tuple[int, int, int]]:
    """(start byte, end byte, first line number) of pieces of about `target` bytes, cut after a newline."""
    cuts = [(0, 1)]
    with open(path, "rb") as f:
        line, pos = 1, 0
        while True:
            goal = cuts[-1][0] + target
            if goal >= size:
                break
            while pos < goal:  # count lines up to the goal, in blocks
                block = f.read(min(1 << 22, goal - pos))
                line += block.count(b"\n")
                pos += len(block)
            rest = f.readline()
            pos += len(rest)
            line += rest.endswith(b"\n")
            if pos >= size:
                break
            cuts.append((pos, line))
    ends = [c[0] for c in cuts[1:]] + [size]
    return [(start, end, first) for (start, first), end in zip(cuts, ends)]


def pieces_of(path: str, target: int, kind: tuple[str, str] | None = None) -> list[Piece]:
    kind = kind or kind_of(path)
    assert kind is not None
    st = os.stat(path)
    base = dict(path=path, kind=kind[0], compression=kind[1], size=st.st_size, mtime_ns=st.st_mtime_ns)
    if kind == ("jsonl", "") and st.st_size > target:
        return [Piece(**base, start=s, end=e, start_line=n) for s, e, n in _jsonl_pieces(path, st.st_size, target)]
    if kind[0] == "parquet" and st.st_size > target:
        pq = _pyarrow()
        try:
            meta = pq.ParquetFile(path).metadata
        except _read_errors():  # damaged: one piece, which its reader reports as unreadable
            return [Piece(**base)]
        groups, acc, start = [], 0, 0
        for g in range(meta.num_row_groups):
            acc += meta.row_group(g).total_byte_size
            if acc >= target and g + 1 < meta.num_row_groups:
                groups.append((start, g + 1))
                start, acc = g + 1, 0
        groups.append((start, meta.num_row_groups))
        return [Piece(**base, start=s, end=e) for s, e in groups]
    return [Piece(**base)]


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("reading .parquet needs the `pyarrow` package: pip install 'torchtrain[data]'") from None
    return pq


def _open_binary(piece: Piece) -> io.BufferedIOBase:
    if piece.compression == "gz":
        return gzip.open(piece.path, "rb")
    if piece.compression == "zst":
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{piece.path}: reading .zst needs the `zstandard` package: "
                             f"pip install 'torchtrain[data]'") from None
        return io.BufferedReader(_Zstd(piece.path, zstandard), 1 << 20)  # readline() needs a buffered stream
    return open(piece.path, "rb")


class _Zstd(io.RawIOBase):
    """A .zst file decompressed frame after frame, raising EOFError when the file ends inside a frame:
    zstandard's own stream_reader returns a truncated stream as if it were complete."""

    def __init__(self, path: str, zstandard):
        self._file = open(path, "rb")
        self._frame = zstandard.ZstdDecompressor().decompressobj
        self._decoder, self._in_frame = self._frame(), False
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data = self._file.read(1 << 18)  # compressed bytes at a time: bounds the memory of one step
            if not data:
                if self._in_frame:
                    raise EOFError("the zstd stream ends inside a frame")
                return 0
            out = []
            while data:
                out.append(self._decoder.decompress(data))
                self._in_frame = not self._decoder.eof
                data = self._decoder.unused_data if self._decoder.eof else b""
                if self._decoder.eof:
                    self._decoder = self._frame()
            self._out, self._pos = b"".join(out), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = memoryview(self._out)[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _text(piece: Piece, problems: list[Problem]) -> Iterator[str]:
    with _open_binary(piece) as f:
        data = f.read()
    if not data.strip():
        problems.append(Problem(piece.path, 0, "empty file (no document)", records=0))
        return
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        problems.append(Problem(piece.path, line, f"not valid UTF-8 (byte {e.start})"))


def _jsonl(piece: Piece, field: str, problems: list[Problem]) -> Iterator[str]:
    found = False
    with _open_binary(piece) as f:
        if piece.end >= 0:
            f.seek(piece.start)
            remaining = piece.end - piece.start
        else:
            remaining = -1
        line_no = piece.start_line - 1
        while remaining != 0:
            raw = f.readline()
            if not raw:
                break
            line_no += 1
            if remaining > 0:
                remaining -= len(raw)
            if not raw.strip():
                continue
            found = True
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                problems.append(Problem(piece.path, line_no, f"not valid UTF-8 (column {e.start + 1})"))
                continue
            except ValueError as e:
                problems.append(Problem(piece.path, line_no, f"not valid JSON ({e})"))
                continue
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                what = "not a JSON object" if not isinstance(record, dict) else (
                    f"no {field!r} field" if field not in record else f"{field!r} is not a string")
                problems.append(Problem(piece.path, line_no, what))
                continue
            if not text:
                problems.append(Problem(piece.path, line_no, f"empty {field!r}", records=0))
                continue
            yield text
    if not found and piece.start == 0:
        problems.append(Problem(piece.path, 0, "empty file (no records)", records=0))


def _parquet(piece: Piece, field: str, problems: list[Problem]) -> Iterator[str]:
    pq = _pyarrow()
    pf = pq.ParquetFile(piece.path)
    end = pf.metadata.num_row_groups if piece.end < 0 else piece.end
    if field not in pf.schema_arrow.names:
        columns = ", ".join(pf.schema_arrow.names)
        rows = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start, end))
        problems.append(Problem(piece.path, 0, f"no {field!r} column (it has: {columns}); the whole file", rows))
        return
    row = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
    if pf.metadata.num_rows == 0:
        problems.append(Problem(piece.path, 0, "empty file (no rows)", records=0))
    for g in range(piece.start, end):
        for value in pf.read_row_group(g, columns=[field]).column(0).to_pylist():
            row += 1
            if not isinstance(value, str) or not value:
                problems.append(Problem(piece.path, row, f"{field!r} is {'empty' if value == '' else 'not a string'}",
                                        records=int(value != "")))
                continue
            yield value


def _arrow(piece: Piece, field: str, problems: list[Problem]) -> Iterator[str]:
    try:
        import pyarrow as pa
    except ImportError:
        raise ValueError("reading .arrow needs the `pyarrow` package: pip install 'torchtrain[data]'") from None
    with pa.memory_map(piece.path) as source:
        try:
            reader = pa.ipc.open_stream(source)  # what `datasets` writes
            batches = iter(reader)
            names = reader.schema.names
        except pa.ArrowInvalid:
            source.seek(0)
            file = pa.ipc.open_file(source)
            batches = (file.get_batch(i) for i in range(file.num_record_batches))
            names = file.schema.names
        if field not in names:
            rows = sum(b.num_rows for b in batches)
            problems.append(Problem(piece.path, 0, f"no {field!r} column (it has: {', '.join(names)}); the whole file",
                                    rows))
            return
        row = 0
        for batch in batches:
            for value in batch.column(names.index(field)).to_pylist():
                row += 1
                if not isinstance(value, str) or not value:
                    problems.append(Problem(piece.path, row, f"{field!r} is "
                                            f"{'empty' if value == '' else 'not a string'}", records=int(value != "")))
                    continue
                yield value
        if row == 0:
            problems.append(Problem(piece.path, 0, "empty file (no rows)", records=0))


def documents(piece: Piece, field: str, problems: list[Problem]) -> Iterator[str]:
    """The documents of `piece`; bad records are appended to `problems` and skipped. Raises `Unreadable`
    when the piece cannot be read to its end (the documents it gave are then to be dropped with it)."""
    if piece.kind == "jsonl":
        reader = _jsonl(piece, field, problems)
    elif piece.kind == "parquet":
        reader = _parquet(piece, field, problems)
    elif piece.kind == "arrow":
        reader = _arrow(piece, field, problems)
    else:
        reader = _text(piece, problems)
    try:
        yield from reader
    except _read_errors() as e:
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise Unreadable(Problem(piece.path, 0, f"cannot be read to its end ({reason}; a truncated or damaged "
                                                f"file?): dropped whole")) from None
