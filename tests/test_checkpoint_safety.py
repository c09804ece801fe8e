"""Safe loading of DCP folders this job did not write (components/checkpoint/safety.py).

A crafted checkpoint whose pickle would create a file -- in `.metadata`, or in a byte entry of a data
file -- is refused by every loading entry point (the trainer's initial load, `torchtrain.generate`,
the converters, scripts/verify_checkpoint.py) with one line naming the file and the class, and the
file is never created. A legacy pickled state with builtins only still reads; the trust key skips the
scan (logged). In-process except the verify script and one one-process trainer start (no training:
it stops at the initial load): about 10 s.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, TINY_JOB, TINY_MODEL, assert_no_traceback, run_train

from torchtrain.components.checkpoint.safety import CheckpointError, safe_loads, scan
from torchtrain.components.checkpoint.validate import read_metadata

sys.path.insert(0, os.path.join(REPO, "scripts"))


class Evil:
    """Unpickling it runs a shell command that creates a file."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {self.target}",)


def _weights() -> dict:
    return {"model": {"tok_embeddings.weight": torch.zeros(4, 4)}, "train_state": {"step": torch.tensor(3)}}


def crafted(folder, where: str) -> tuple[str, str]:
    """(a DCP folder with a malicious pickle in its `.metadata` or in a byte entry, the file it would create)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = str(folder / "pwned")
    path = str(folder / "step-1")
    state = _weights()
    if where == "entry":
        state["dataloader"] = {"dp_rank_0": Evil(target)}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    if where == "metadata":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(Evil(target), f)
    return path, target


@pytest.mark.parametrize("where", ["metadata", "entry"])
def test_crafted_checkpoint_is_refused_by_every_in_process_entry_point(tmp_path, where, capsys):
    import convert_dcp_to_hf
    import convert_to_torchtitan
    import verify_checkpoint

    from torchtrain import generate

    path, target = crafted(tmp_path, where)
    with pytest.raises(CheckpointError) as e:
        read_metadata(path, "checkpoint.initial_load_path")
    cls = "posix.system" if os.name == "posix" else "nt.system"
    assert cls in str(e.value) and "\n" not in str(e.value)
    assert (".metadata" if where == "metadata" else "__0_0.distcp (key 'dataloader.dp_rank_0')") in str(e.value)
    model = ["--model.name", "llama3", *TINY_MODEL]
    assert convert_dcp_to_hf.main([path, str(tmp_path / "hf"), *model]) == 2
    assert convert_to_torchtitan.main([path, str(tmp_path / "titan"), *model]) == 2
    assert generate.main(["--checkpoint", path, "--prompt", "hi", "--max-new-tokens", "2", *model]) == 2
    assert verify_checkpoint.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if cls in line]
    assert len(lines) == 4 and "Traceback" not in err, err
    assert not os.path.exists(target)


def test_trainer_initial_load_of_a_crafted_checkpoint_is_one_line_and_runs_nothing(tmp_path):
    path, target = crafted(tmp_path / "other", "entry")
    out = run_train([*TINY_JOB, "--training.steps", "1", "--checkpoint.enable", "--job.dump_folder",
                     str(tmp_path / "job"), "--checkpoint.initial_load_path", path], timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    refusal = [line for line in out.stderr.splitlines() if "posix.system" in line]
    assert len(refusal) == 1 and "refused before loading" in refusal[0], out.stderr[-3000:]
    assert_no_traceback(out.stderr)
    assert not os.path.exists(target)


def test_scan_report_and_verify_script_on_a_clean_folder(tmp_path):
    path = str(tmp_path / "step-1")
    dcp.save({**_weights(), "lr_scheduler": {"last_epoch": 3}, "optimizer": {"betas": (0.9, 0.95)}},
             checkpoint_id=path, no_dist=True)
    report = scan(path)
    assert report.byte_entries == 2 and report.pickles == 3
    assert "torch.distributed.checkpoint.metadata.Metadata" in report.classes
    assert all(c.startswith(("torch.", "pathlib.")) for c in report.classes), report.classes
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "scripts/verify_checkpoint.py", str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"ok: {path}: 3 pickles"), out.stdout + out.stderr


def test_legacy_state_reads_with_builtins_only_and_trust_skips_the_scan(tmp_path, caplog):
    legacy = pickle.dumps({"samples": 12, "epochs": [0], "fingerprint": {"seed": 1}})
    assert safe_loads(legacy)["samples"] == 12
    with pytest.raises(CheckpointError, match="posix.system"):
        safe_loads(pickle.dumps(Evil(str(tmp_path / "x"))))
    path, target = crafted(tmp_path, "entry")
    from torchtrain.utils.logging import logger

    caplog.set_level(logging.WARNING, logger=logger.name)  # whatever an earlier test in this process set
    logger.addHandler(caplog.handler)
    try:
        read_metadata(path, "checkpoint.initial_load_path", trusted=True)  # the metadata itself is clean
    finally:
        logger.removeHandler(caplog.handler)
    assert "WITHOUT the pickle scan (trusted by configuration)" in caplog.text
    assert not os.path.exists(target)  # reading the metadata does not touch the byte entries
