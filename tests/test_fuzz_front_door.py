"""A seeded, bounded fuzz of the front door: everything a user hands the trainer before it starts.

Classes of input (each case is one call of the function a launcher, the trainer or the preparation
tool calls first, in this process):

* toml: the shipped train_configs/*.toml, parsed and mutated (a value of the wrong type, out of range,
  huge, negative, NaN/inf, unicode or empty; an unknown or misspelled key or section; a table where a
  value belongs) or damaged as bytes (truncated, bytes flipped, invalid UTF-8, UTF-16, a BOM), checked
  by `launch_check.check` as run_train.sh does;
* cli: `--section.key value` overrides over debug_model.toml: real keys with wrong values, unknown and
  misspelled keys, missing values, `=` forms, unicode, huge numbers;
* manifest: a prepared token folder whose manifest.json or shard files are damaged (truncated,
  binary, wrong encoding, wrong JSON types, missing fields, huge numbers), checked by the launch check;
* prepare: `python -m torchtrain.data.prepare` inputs (truncated, binary, latin-1, UTF-16, bad JSON
  records, wrong field types, damaged .gz/.zst, empty);
* checkpoint: a DCP folder whose `.metadata` or data file is truncated or has flipped bytes, read by
  `validate.read_metadata` (the pickle scan, then DCP's metadata) as every loading entry point does.

Every case must end in a valid result or a ConfigError-style error (one line for config errors; the
preparation tool's exit status with its messages), never another exception, a hang (20 s alarm per
case) or -- for `prepare` -- a dataset folder left with a manifest after a failure. The test prints the
number of cases per class and asserts 0 uncaught exceptions. About 15-30 s.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import gzip
import io
import json
import math
import os
import random
import shutil
import signal
import traceback
import warnings
from collections import Counter

import pytest
import tomllib
from conftest import REPO

from torchtrain import launch_check
from torchtrain.config import ConfigError
from torchtrain.data import prepare
from torchtrain.data.format import MANIFEST

SEED = int(os.environ.get("TORCHTRAIN_FUZZ_SEED", "20250101"))  # another seed explores further
CASE_TIMEOUT_S = 20
WEIRD = ["text", "", "ünïcødé ✓ 日本", "\u202e\u0000", 3, 0, -1, -(10**30), 10**30, 2**63, 1.5, -0.5, 1e308,
         float("inf"), float("nan"), True, False, [1, "a"], [], {"x": 1}, "1e999", "0x10", " 7 "]
CLI_VALUES = ["", "abc", "-1", "0", "1e999", "nan", "inf", "99999999999999999999999", "1.5", "true", "[1,2]",
              "ünïcødé", "--", "=", "none", "{}", "\x00", "🙂" * 10]


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"no answer within {CASE_TIMEOUT_S} s")


# ------------------------------------------------------------------------------------------ TOML writing
def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=True)  # TOML basic strings share JSON's escapes
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def dump_toml(data: dict) -> str:
    lines = []

    def table(prefix: str, body: dict) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict)}
        lines.append(f"[{prefix}]")
        lines.extend(f"{json.dumps(k)} = {_value(v)}" for k, v in scalars.items())
        for k, v in body.items():
            if isinstance(v, dict):
                table(f"{prefix}.{json.dumps(k)}", v)

    for section, body in data.items():
        if isinstance(body, dict):
            table(json.dumps(section), body)
        else:
            lines.insert(0, f"{json.dumps(section)} = {_value(body)}")
    return "\n".join(lines) + "\n"


def _misspell(rng: random.Random, key: str) -> str:
    if len(key) < 3:
        return key + "x"
    i = rng.randrange(len(key) - 1)
    wrong = rng.choice([key[:i] + key[i + 1:], key[:i] + key[i + 1] + key[i] + key[i + 2:], key.upper(),
                        key.replace("_", "-"), key + "s"])
    return wrong if wrong != key else key + "s"


def mutate_tree(rng: random.Random, data: dict) -> tuple[str, dict]:
    data = copy.deepcopy(data)
    section = rng.choice(list(data))
    body = data[section]
    kind = rng.choice(["value", "value", "value", "unknown_key", "misspelled_key", "unknown_section",
                       "table_for_value", "section_as_value", "drop_section"])
    if kind in ("value", "misspelled_key", "table_for_value") and body:
        key = rng.choice(list(body))
        if kind == "value":
            body[key] = rng.choice(WEIRD)
        elif kind == "misspelled_key":
            body[_misspell(rng, key)] = body.pop(key)
        else:
            body[key] = {"nested": rng.choice(WEIRD)}
    elif kind == "unknown_key":
        body[f"no_such_key_{rng.randrange(100)}"] = rng.choice(WEIRD)
    elif kind == "unknown_section":
        data[_misspell(rng, section)] = dict(body)
    elif kind == "section_as_value":
        data[section] = rng.choice(WEIRD[:8])
    else:
        del data[section]
    return kind, data


def mutate_bytes(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    kind = rng.choice(["truncated", "flipped", "invalid_utf8", "utf16", "bom", "nul"])
    if kind == "truncated":
        return kind, raw[:rng.randrange(len(raw))]
    if kind == "flipped":
        b = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return kind, bytes(b)
    if kind == "invalid_utf8":
        i = rng.randrange(len(raw))
        return kind, raw[:i] + b"\xff\xfe\xc3" + raw[i:]
    if kind == "utf16":
        return kind, raw.decode().encode("utf-16")
    if kind == "bom":
        return kind, b"\xef\xbb\xbf" + raw
    return kind, raw.replace(b"\n", b"\x00\n", 3)


# ------------------------------------------------------------------------------------------ the harness
class Fuzz:
    def __init__(self):
        self.cases: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.uncaught: list[str] = []

    def run(self, cls: str, what: str, fn, check_error=None, must_fail: bool = False) -> None:
        """One case; `must_fail`: a valid outcome is wrong too (an unknown key accepted)."""
        self.cases[cls] += 1
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(CASE_TIMEOUT_S)
        try:
            outcome = fn() or "valid"
            self.outcomes[f"{cls}: {outcome}"] += 1
            if must_fail and outcome == "valid":
                self.uncaught.append(f"{cls} [{what}]: accepted")
        except ConfigError as e:
            message = str(e)
            if "\n" in message.strip() or not message.strip():
                self.uncaught.append(f"{cls} [{what}]: a config error of several lines: {message[:300]!r}")
            self.outcomes[f"{cls}: config error"] += 1
            if check_error is not None:
                check_error(message)
        except (Exception, Hang, SystemExit) as e:
            tb = traceback.format_exc().strip().splitlines()
            self.uncaught.append(f"{cls} [{what}]: {type(e).__name__}: {str(e)[:200]} at {tb[-3:-1]}")
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


def _check(args: list[str], nproc: str = "2", nnodes: str = "1") -> None:
    launch_check.check(["--nproc-per-node", nproc, "--nnodes", nnodes, *args])


def fuzz_toml(fz: Fuzz, rng: random.Random, tmp: str, per_file: int) -> None:
    for path in sorted(glob.glob(os.path.join(REPO, "train_configs", "*.toml"))):
        raw = open(path, "rb").read()
        tree = tomllib.loads(raw.decode())
        for i in range(per_file):
            out = os.path.join(tmp, f"{os.path.basename(path)}.{i}.toml")
            if rng.random() < 0.7:
                kind, mutated = mutate_tree(rng, tree)
                data = dump_toml(mutated).encode()
            else:
                kind, data = mutate_bytes(rng, raw)
            with open(out, "wb") as f:
                f.write(data)
            fz.run("toml", f"{os.path.basename(path)} {kind}", lambda: _check(["--job.config_file", out]),
                   must_fail=kind in ("unknown_key", "misspelled_key", "unknown_section"))


def fuzz_cli(fz: Fuzz, rng: random.Random, count: int) -> None:
    from torchtrain.config.manager import _leaf_fields, _sections

    keys = [f"{s}.{k}" for s, cls in _sections().items() for k in _leaf_fields(cls)]
    base = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml")]
    for _ in range(count):
        key = rng.choice(keys)
        kind = rng.choice(["value", "value", "eq", "missing", "unknown", "misspelled", "positional"])
        value = rng.choice(CLI_VALUES)
        args = {"value": [f"--{key}", value], "eq": [f"--{key}={value}"], "missing": [f"--{key}"],
                "unknown": [f"--{key}_zz", value], "misspelled": [f"--{_misspell(rng, key)}", value],
                "positional": [value or "x"]}[kind]
        fz.run("cli", f"{kind} {args}", lambda: _check([*base, *args]),
               must_fail=kind in ("unknown", "misspelled", "positional"))


def fuzz_manifest(fz: Fuzz, rng: random.Random, tmp: str, count: int) -> None:
    text = os.path.join(tmp, "docs.txt")
    with open(text, "w") as f:
        f.write("\n".join(f"document {i} " + "word " * (i % 40) for i in range(400)))
    good = os.path.join(tmp, "tokens")
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert prepare.main([text, "--out", good]) == 0
    manifest = json.load(open(os.path.join(good, MANIFEST)))
    job = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"), "--training.dataset",
           "tokens", "--training.seq_len", "16", "--model.vocab_size", "512"]
    for i in range(count):
        folder = os.path.join(tmp, f"tokens{i}")
        shutil.copytree(good, folder)
        target = rng.choice(["manifest", "manifest", "manifest", "shard"])
        if target == "manifest":
            kind = rng.choice(["truncated", "binary", "utf16", "latin1", "types", "missing", "huge", "not_object"])
            raw = open(os.path.join(good, MANIFEST), "rb").read()
            m = copy.deepcopy(manifest)
            if kind == "truncated":
                raw = raw[:rng.randrange(len(raw))]
            elif kind == "binary":
                raw = bytes(rng.randrange(256) for _ in range(200))
            elif kind == "utf16":
                raw = raw.decode().encode("utf-16")
            elif kind == "latin1":
                raw = raw.replace(b'"', "\"\u00e9".encode("latin-1"), 1)
            else:
                key = rng.choice(list(m))
                if kind == "types":
                    m[key] = rng.choice(WEIRD[:15] + [None])
                elif kind == "missing":
                    del m[key]
                elif kind == "huge":
                    m[key] = 10**30 if not isinstance(m[key], list) else [10**30]
                else:
                    m = [m]
                raw = json.dumps(m).encode()
            with open(os.path.join(folder, MANIFEST), "wb") as f:
                f.write(raw)
        else:
            kind = rng.choice(["truncated_bin", "truncated_idx", "missing_bin", "garbage_idx"])
            name = sorted(glob.glob(os.path.join(folder, "shard-*" + (".bin" if "bin" in kind else ".idx"))))[0]
            if kind.startswith("truncated"):
                os.truncate(name, os.path.getsize(name) // 2)
            elif kind == "missing_bin":
                os.remove(name)
            else:
                with open(name, "r+b") as f:
                    f.write(bytes(rng.randrange(256) for _ in range(64)))
        fz.run("manifest", f"{target} {kind}",
               lambda: _check([*job, "--training.dataset_path", folder], nproc="1", nnodes="1:2"))


def fuzz_prepare(fz: Fuzz, rng: random.Random, tmp: str, count: int) -> None:
    good_lines = [json.dumps({"text": f"record {i} " + "ab " * i}) for i in range(50)]
    for i in range(count):
        kind = rng.choice(["truncated_jsonl", "binary_txt", "latin1_txt", "utf16_txt", "bad_records", "field_types",
                           "gz_truncated", "zst_garbage", "empty", "nul_txt"])
        ext = {"gz_truncated": ".jsonl.gz", "zst_garbage": ".jsonl.zst"}.get(kind, ".jsonl" if "json" in kind or
                                                                              kind in ("bad_records", "field_types")
                                                                              else ".txt")
        path = os.path.join(tmp, f"in{i}{ext}")
        body = "\n".join(good_lines).encode()
        data = {
            "truncated_jsonl": body[:rng.randrange(1, len(body))],
            "binary_txt": bytes(rng.randrange(256) for _ in range(2000)),
            "latin1_txt": "caf\u00e9 na\u00efve \u00fcber\n".encode("latin-1") * 20,
            "utf16_txt": "text in utf-16 \u00e9\n".encode("utf-16") * 20,
            "bad_records": b"\n".join([b"{not json", b"[1, 2]", b'"a string"', b"null", *[x.encode() for x in good_lines]]),
            "field_types": b"\n".join(json.dumps({"text": v}).encode() for v in [1, None, [1], {"a": 1}, True, 1e308]),
            "gz_truncated": gzip.compress(body)[:rng.randrange(10, 60)],
            "zst_garbage": b"\x28\xb5\x2f\xfd" + bytes(rng.randrange(256) for _ in range(100)),
            "empty": b"",
            "nul_txt": b"hello\x00world\n" * 10,
        }[kind]
        with open(path, "wb") as f:
            f.write(data)
        out = os.path.join(tmp, f"out{i}")

        def run(path=path, out=out, kind=kind):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = prepare.main([path, "--out", out])
            if code == 0:
                from torchtrain.data.format import TokenCorpus

                TokenCorpus(out)  # a valid dataset
                return "valid"
            assert not os.path.exists(os.path.join(out, MANIFEST)), f"{kind}: a failed preparation left a dataset"
            assert "Traceback" not in err.getvalue(), err.getvalue()[-2000:]
            return "error"
        fz.run("prepare", kind, run)


def fuzz_checkpoint(fz: Fuzz, rng: random.Random, tmp: str, count: int) -> None:
    """A DCP folder whose `.metadata` or data file is damaged, read as every loader reads it first."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtrain.components.checkpoint.validate import read_metadata

    good = os.path.join(tmp, "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process"
        dcp.save({"model": {"w": torch.ones(3, 2)}, "lr_scheduler": {"last_epoch": 3}, "optimizer": {"b": (0.9, 0.95)},
                  "dataloader": {"dp_rank_0": b"\x80\x04K\x01."}}, checkpoint_id=good, no_dist=True)
    for i in range(count):
        folder = os.path.join(tmp, f"ckpt{i}")
        shutil.copytree(good, folder)
        name = rng.choice([".metadata", ".metadata", "__0_0.distcp"])
        data = open(os.path.join(folder, name), "rb").read()
        kind = rng.choice(["truncated", "flipped", "flipped", "zeroed"])
        if kind == "truncated":
            data = data[:rng.randrange(len(data))]
        elif kind == "flipped":
            data = bytes(b ^ rng.randrange(1, 256) if rng.random() < 0.02 else b for b in data)
        else:
            start = rng.randrange(len(data))
            data = data[:start] + bytes(min(64, len(data) - start)) + data[start + 64:]
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
        fz.run("checkpoint", f"{name} {kind}", lambda: read_metadata(folder, "fuzz") and None)


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the per-case time limit uses SIGALRM")
def test_front_door_fuzz(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the shipped configs' relative paths
    monkeypatch.setenv("TORCHTRAIN_CACHE", str(tmp_path / "cache"))
    rng = random.Random(SEED)
    fz = Fuzz()
    _check(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml")])  # imports, untimed
    fuzz_toml(fz, rng, str(tmp_path), per_file=40)
    fuzz_cli(fz, rng, 400)
    fuzz_manifest(fz, rng, str(tmp_path), 80)
    fuzz_prepare(fz, rng, str(tmp_path), 60)
    fuzz_checkpoint(fz, rng, str(tmp_path), 80)
    total = sum(fz.cases.values())
    print(f"\nfront-door fuzz (seed {SEED}): {total} cases: " + ", ".join(f"{k} {v}" for k, v in fz.cases.items()))
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(fz.outcomes.items())))
    print(f"uncaught: {len(fz.uncaught)}")
    assert not fz.uncaught, "\n".join(fz.uncaught[:30])
