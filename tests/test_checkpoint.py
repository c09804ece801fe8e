"""Checkpointing end to end under real torchrun + gloo (tiny model, 8 steps, a save every 2 or 4 steps).

Equalities and tolerances:
* exact resume (same layout): per-step losses BITWISE equal to the uninterrupted run; weights,
  optimizer state, schedule, data position and RNG are restored exactly and CPU kernels run in
  deterministic mode, so any difference at all is a bug;
* reshard (FSDP 4 -> FSDP 2, -> 1 process, same global batch): relative loss difference <= 1e-4 per
  step. The same weights and data are used; only the floating-point summation order of the
  reductions changes (~1e-6 in fp32 over a few steps, as in tests/test_distributed.py), while a wrong
  weight, optimizer moment or data position shows up at 1e-2 or worse.
Runs are shared between tests by module-scoped fixtures: 16 runs (10 of 2 processes, 3 of 4, 3 of one),
about 3 minutes on 2 CPU cores shared with other work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    FAULT_INJECTION,
    REPO,
    TINY_JOB,
    assert_no_traceback,
    assert_no_trainer_traceback,
    read_metrics,
    run_together,
    run_train,
    train_command,
    wait_for_pid_file,
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

pytestmark = pytest.mark.dist
RTOL = 1e-4
sys.path.insert(0, os.path.join(REPO, "scripts"))  # verify_checkpoint


def job(dump, *extra: str) -> list[str]:
    return [*TINY_JOB, "--training.steps", "8", "--metrics.log_freq", "1", "--debug.deterministic",
            "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--job.dump_folder", str(dump), *extra]


def ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def losses(dump) -> dict[int, float]:
    """Step -> loss; a step logged twice (re-run after a crash) keeps its latest value."""
    return {r["step"]: r["loss"] for r in read_metrics(str(dump))}


def trained_steps(dump) -> int:
    path = os.path.join(str(dump), "metrics.jsonl")
    return len(read_metrics(str(dump))) if os.path.exists(path) else 0


def ckpt(dump, step: int) -> str:
    return os.path.join(str(dump), "checkpoint", f"step-{step}")


def marker(path: str) -> dict:
    with open(os.path.join(path, "complete.json")) as f:
        return json.load(f)


def copy_step(src_dump, step: int, dst_dump) -> None:
    shutil.copytree(ckpt(src_dump, step), ckpt(dst_dump, step))


def load_all(path: str) -> dict:
    """Every entry of a DCP checkpoint (tensors and bytes), loaded in this process."""
    md = FileSystemReader(path).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
             for k, v in md.state_dict_metadata.items()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


# ----------------------------------------------------------------------------------------------- FSDP 2
@pytest.fixture(scope="module")
def fsdp2_ref(tmp_path_factory):
    """The uninterrupted FSDP 2 run: saves steps 2, 4, 6, 8, keeps all."""
    dump = tmp_path_factory.mktemp("fsdp2_ref")
    ok(run_train(job(dump, "--checkpoint.keep_latest_k", "0"), nproc=2))
    return dump


def _preempt(args: list[str], step: int, signal_in_save: str, launcher_args=(), group: bool = True):
    """Run the job until rank 1 has finished `step` (a test hook parks it there until a preemption signal
    arrives, so the signal lands at a known step), then send SIGTERM to the launch's whole process group, or
    to that worker only; during the save the hook sends `signal_in_save` once more. Returns (exit status,
    output)."""
    cmd, env = train_command(args, 2, {"TORCHTRAIN_TEST_WAIT_FOR_SIGNAL": f"{step}:1",
                                       "TORCHTRAIN_TEST_SIGNAL_IN_SAVE": signal_in_save})
    cmd[3:3] = launcher_args  # after `python -m torchtrain.launcher`
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                            start_new_session=True)  # its own process group, as under a scheduler
    pid_file = os.path.join(args[args.index("--job.dump_folder") + 1], "test_waiting_rank1.pid")
    pid = wait_for_pid_file(proc, pid_file, f"rank 1 never reached step {step}")
    os.killpg(proc.pid, signal.SIGTERM) if group else os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    os.remove(pid_file)
    return proc.returncode, output


def test_preemption_saves_whoever_gets_the_signal_and_resumes_exactly(fsdp2_ref, tmp_path):
    """Also the FSDP 2 exact-resume test. One job preempted three times, then finished:

    * after step 2, SIGTERM to rank 1 only (the agent is not signalled: rank 0 learns of it through the
      step-boundary agreement), and again to rank 1 during the save: every rank saves and exits 0;
    * after step 4, what `scancel` or a preempting scheduler does: SIGTERM to every process of the launch
      (agent, forkserver, workers) on the forkserver path (the default on CPU), and again to all of them
      during the save: the save completes, the launcher exits 128 + 15 with one line. (Before the
      forkserver ignored the workers' signals it died of the first SIGTERM, and its workers got a
      KeyboardInterrupt in the middle of the save);
    * after step 6, the same on torchrun's spawn path;
    * the same command again trains steps 7 and 8: the losses equal the uninterrupted run's bitwise."""
    args = job(tmp_path, "--checkpoint.interval", "100", *FAULT_INJECTION)
    code, out = _preempt(args, 2, "1:SIGTERM", group=False)
    assert code == 0, out[-4000:]
    assert "rank 1 received SIGTERM" in out and "checkpoint step-2 saved, exiting" in out
    assert marker(ckpt(tmp_path, 2))["contents"][:2] == ["model", "optimizer"]
    for step, launcher_args in ((4, ()), (6, ("--start-method", "spawn"))):
        code, out = _preempt(args, step, "1:SIGTERM:group", launcher_args)
        assert code == 128 + signal.SIGTERM, out[-4000:]
        assert f"training continues at step {step - 1}" in out and f"checkpoint step-{step} saved, exiting" in out
        assert "torchtrain: stopped by SIGTERM" in out
        assert_no_traceback(out)
        assert marker(ckpt(tmp_path, step))["step"] == step and max(losses(tmp_path)) == step
    out = ok(run_train(args, nproc=2))  # the requeued job
    assert f"resumed from {ckpt(tmp_path, 6)}" in out.stdout and "training continues at step 7" in out.stdout
    ref, got = losses(fsdp2_ref), losses(tmp_path)
    assert sorted(got) == list(range(1, 9)) and all(got[s] == ref[s] for s in got), (ref, got)


@pytest.fixture(scope="module")
def hf_seed(tmp_path_factory):
    """A seed checkpoint (step-0) created under FSDP 2 from HF weights that equal the built-in init."""
    from torchtrain.components.checkpoint.hf import export_dcp_to_hf
    from torchtrain.config import parse_args
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.distributed.param_init import init_model_weights
    from torchtrain.models.registry import build_model_args, get_model_spec

    root = tmp_path_factory.mktemp("hf_seed")
    cfg = parse_args(list(TINY_JOB))
    spec = get_model_spec("llama3")
    args = build_model_args(spec, cfg.model.flavor, cfg.model.overrides)
    args.update_from_job(cfg.training.seq_len, build_tokenizer(None))
    model = spec.model_cls(args)
    init_model_weights(model, cfg.debug.seed)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "dcp"), no_dist=True)
    export_dcp_to_hf(str(root / "dcp"), str(root / "hf"), spec.state_dict_adapter(args), max_shard_bytes=200_000)
    dump = root / "run"
    out = ok(run_train(job(dump, "--checkpoint.create_seed_checkpoint", "--checkpoint.initial_load_in_hf",
                           "--checkpoint.initial_load_path", str(root / "hf")), nproc=2))
    return dump, out, model


def test_seed_checkpoint_from_hf_weights(hf_seed):
    dump, out, model = hf_seed
    assert "initial load of Hugging Face weights" in out.stdout and "seed checkpoint written" in out.stdout
    assert trained_steps(dump) == 0
    meta = marker(ckpt(dump, 0))
    assert meta["contents"] == ["model"] and meta["step"] == 0
    saved = load_all(ckpt(dump, 0))
    for key, value in model.state_dict().items():
        assert torch.equal(saved[f"model.{key}"], value), key  # HF import under FSDP 2 is exact


def test_kill9_mid_save_keeps_previous_and_is_skipped(fsdp2_ref, hf_seed, tmp_path):
    copy_step(hf_seed[0], 0, tmp_path)  # start from the seed: must equal the built-in init bitwise
    out = run_train(job(tmp_path, *FAULT_INJECTION), nproc=2, env={"TORCHTRAIN_TEST_CRASH_IN_SAVE": "4:1"})
    assert out.returncode != 0
    assert f"resumed from {ckpt(tmp_path, 0)}" in out.stdout
    assert os.path.exists(os.path.join(ckpt(tmp_path, 2), "complete.json"))
    assert os.path.isdir(ckpt(tmp_path, 4)) and not os.path.exists(os.path.join(ckpt(tmp_path, 4), "complete.json"))
    ref = losses(fsdp2_ref)
    crashed = losses(tmp_path)
    assert sorted(crashed) == [1, 2, 3, 4] and all(crashed[s] == ref[s] for s in crashed)
    out = ok(run_train(job(tmp_path), nproc=2))
    assert "step-4 is incomplete" in out.stdout and "skipped" in out.stdout
    assert f"resumed from {ckpt(tmp_path, 2)}" in out.stdout
    got = losses(tmp_path)
    assert all(got[s] == ref[s] for s in range(1, 9)), (ref, got)
    assert os.path.exists(os.path.join(ckpt(tmp_path, 4), "complete.json"))  # replaced by a complete one


def test_async_save_equals_sync_and_keep_latest_k(fsdp2_ref, tmp_path):
    out = ok(run_train(job(tmp_path, "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2"),
                       nproc=2))
    assert "writing in the background" in out.stdout
    assert sorted(os.listdir(os.path.join(str(tmp_path), "checkpoint"))) == ["step-6", "step-8"]
    assert "purged old checkpoint" in out.stdout
    assert losses(tmp_path) == losses(fsdp2_ref)
    for step in (6, 8):  # 6 was written in the background, 8 (the last step) synchronously
        assert sorted(os.listdir(ckpt(tmp_path, step))) == sorted(os.listdir(ckpt(fsdp2_ref, step)))
        sync, async_ = load_all(ckpt(fsdp2_ref, step)), load_all(ckpt(tmp_path, step))
        assert sync.keys() == async_.keys()
        for key, value in sync.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, async_[key]), key
            else:
                assert value == async_[key], key


def test_fresh_checkpoint_holds_no_pickled_state(fsdp2_ref):
    """The pickle scan over a fresh checkpoint: its pickles import DCP's metadata classes (and dtypes)
    only, and the loader, RNG and train states are tensors, not byte entries."""
    from torchtrain.components.checkpoint.safety import METADATA_CLASSES, scan

    report = scan(ckpt(fsdp2_ref, 8))
    dcp_classes = {f"{m}.{n}" for m, n in METADATA_CLASSES}
    others = {c for c in report.classes - dcp_classes if not isinstance(getattr(torch, c[6:], None), torch.dtype)}
    assert not others and report.byte_entries > 0, (others, report.describe())
    md = FileSystemReader(ckpt(fsdp2_ref, 8)).read_metadata()
    own = {k: v for k, v in md.state_dict_metadata.items() if k.startswith(("dataloader.", "rng.", "train_state."))}
    assert len(own) == 7 and all(isinstance(v, TensorStorageMetadata) for v in own.values()), own  # 2 + 2 + 3


def test_checkpoint_with_pickled_states_resumes_exactly(fsdp2_ref, tmp_path):
    """A checkpoint written before the loader and RNG states were JSON tensors (pickled bytes), the
    train state int64 tensors (plain ints) and the marker held file hashes passes the scan and resumes
    bitwise."""
    import base64
    import pickle

    from torchtrain.components.checkpoint.safety import scan

    src = ckpt(fsdp2_ref, 4)
    state = load_all(src)
    for key, value in list(state.items()):
        if key.startswith("dataloader."):
            state[key] = pickle.dumps(json.loads(bytes(value.numpy()).decode()))
        elif key.startswith("rng."):
            rng = json.loads(bytes(value.numpy()).decode())
            version, internal, gauss = rng["python"]
            state[key] = pickle.dumps({"python": (version, tuple(internal), gauss),
                                       "torch": base64.b64decode(rng["torch"])})
        elif key.startswith("train_state."):
            state[key] = int(value)
    dcp.save(state, checkpoint_id=ckpt(tmp_path, 4), no_dist=True)
    legacy_marker(src, ckpt(tmp_path, 4))  # these checkpoints predate the file hashes too
    assert scan(ckpt(tmp_path, 4)).pickles > 1  # the legacy blobs are read, with builtins only
    out = ok(run_train(job(tmp_path), nproc=2))
    assert f"resumed from {ckpt(tmp_path, 4)}" in out.stdout and "training continues at step 5" in out.stdout
    ref, got = losses(fsdp2_ref), losses(tmp_path)
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == ref[s] for s in got), (ref, got)


def legacy_marker(src: str, dst: str) -> None:
    """dst's completion marker: src's as torchtrain wrote it before it hashed the files (no "files")."""
    meta = {k: v for k, v in marker(src).items() if k not in ("files", "hash")}
    with open(os.path.join(dst, "complete.json"), "w") as f:
        json.dump(meta, f)


def test_truncated_checkpoint_without_hashes_is_a_clear_error_on_every_rank(fsdp2_ref, tmp_path):
    """A checkpoint written before the file hashes loads unverified (said so); its truncated data file is
    found by the metadata check instead, before any data is read."""
    copy_step(fsdp2_ref, 4, tmp_path)
    legacy_marker(ckpt(fsdp2_ref, 4), ckpt(tmp_path, 4))
    data = os.path.join(ckpt(tmp_path, 4), "__1_0.distcp")
    os.truncate(data, os.path.getsize(data) // 2)
    out = run_train(job(tmp_path), nproc=2, timeout=300)
    assert out.returncode != 0
    assert "has no file hashes (written before torchtrain hashed its files): loaded without verifying" in out.stdout
    assert "config error: [checkpoint] step-4" in out.stderr and "__1_0.distcp is truncated" in out.stderr
    assert "key '" in out.stderr
    assert_no_trainer_traceback(out.stderr)  # a message, not a traceback


def test_corrupt_checkpoints_are_skipped_and_a_failed_save_does_not_end_the_run(fsdp2_ref, tmp_path):
    """Storage in trouble. The newest checkpoint has a truncated shard, the one before a flipped byte: each is
    named in one line with its file, and the run resumes from the one before them. Its save of step 4 then
    fails mid-write on rank 1 (no space left: the file is cut short, the write raises ENOSPC): the run goes on,
    the failure is in the log and the metrics, the partial folder is gone, the next checkpoint is good and
    nothing older was deleted. The losses equal the uninterrupted run's bitwise. scripts/verify_checkpoint.py
    fails on the corrupt checkpoints offline, and passes on the folder afterwards."""
    import verify_checkpoint

    for step in (2, 4, 6):
        copy_step(fsdp2_ref, step, tmp_path)
    saved = marker(ckpt(fsdp2_ref, 6))
    assert saved["hash"] == "crc32" and sorted(saved["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    flipped = os.path.join(ckpt(tmp_path, 4), "__0_0.distcp")
    with open(flipped, "r+b") as f:
        f.seek(os.path.getsize(flipped) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))
    os.truncate(os.path.join(ckpt(tmp_path, 6), "__1_0.distcp"), 1000)
    folder = os.path.join(str(tmp_path), "checkpoint")
    assert verify_checkpoint.main([folder]) == 1 and verify_checkpoint.main([ckpt(tmp_path, 2)]) == 0
    out = ok(run_train(job(tmp_path, *FAULT_INJECTION), nproc=2, env={"TORCHTRAIN_TEST_FAIL_SAVE": "4:1"}))
    named = [line for line in out.stdout.splitlines() if " is corrupt: " in line]
    assert len(named) == 2, out.stdout[-3000:]
    assert f"{ckpt(tmp_path, 6)} is corrupt: __1_0.distcp has 1000 bytes" in named[0] and "(truncated)" in named[0]
    assert f"{ckpt(tmp_path, 4)} is corrupt: __0_0.distcp has crc32 " in named[1]
    assert f"resumed from {ckpt(tmp_path, 2)}" in out.stdout and "replacing the corrupt checkpoint" in out.stdout
    failed = [line for line in out.stdout.splitlines() if "checkpoint step-4 failed" in line]
    assert len(failed) == 1 and "rank 1: OSError: [Errno 28] No space left on device" in failed[0], out.stdout[-3000:]
    assert "partial folder was removed; training goes on" in failed[0]
    assert sorted(os.listdir(folder)) == ["step-2", "step-6", "step-8"]
    assert verify_checkpoint.main([folder]) == 0
    records = {r["step"]: r for r in read_metrics(str(tmp_path))}
    assert records[5]["checkpoint_failures"] == 1 and records[5]["checkpoint_failure"].startswith("step-4: rank 1")
    ref, got = losses(fsdp2_ref), losses(tmp_path)
    assert sorted(got) == list(range(3, 9)) and all(got[s] == ref[s] for s in got), (ref, got)


def test_checkpoint_of_another_model_shape_is_a_clear_error(fsdp2_ref, tmp_path):
    copy_step(fsdp2_ref, 4, tmp_path)
    out = run_train(job(tmp_path, "--model.dim", "128"), timeout=300)  # one process, no torchrun
    assert out.returncode == 2
    assert ("[checkpoint] step-4" in out.stderr and "has shape (512, 64) in the checkpoint but (512, 128) in this run"
            in out.stderr), out.stderr[-3000:]


# ----------------------------------------------------------------------------------------------- HSDP 2 x 2
HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]
HF_EXPORT = ["--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype",
             "bfloat16", "--checkpoint.hf_max_shard_bytes", "100000", "--checkpoint.interval", "4"]


GLOBAL_8 = ["--training.global_batch_size", "8", "--checkpoint.interval", "4"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.fixture(scope="module")
def refs4(tmp_path_factory):
    """The uninterrupted 4-rank runs the tests below resume, reshard or reload, one after another in one
    launch (conftest.run_together):

    * hsdp: HSDP 2x2, full saves at 4, a bf16 model-only save + HF export at 8;
    * fsdp4: FSDP 4 with a global batch of 8, saves at 4 and 8;
    * pp_tp: PP 2 x TP 2 (DTensor parameters, one model part per stage), saves at 4 and 8."""
    root = tmp_path_factory.mktemp("refs4")
    jobs = {"hsdp": [*HSDP, *HF_EXPORT], "fsdp4": GLOBAL_8, "pp_tp": [*PP2, *TP2, "--checkpoint.interval", "4"]}
    outcomes = run_together([job(root / name, *extra) for name, extra in jobs.items()], 4, str(root))
    for returncode, log in outcomes:
        assert returncode == 0, log[-4000:]
    return {name: root / name for name in jobs}


@pytest.fixture(scope="module")
def hsdp_ref(refs4):
    return refs4["hsdp"]


def test_exact_resume_hsdp(hsdp_ref, tmp_path):
    copy_step(hsdp_ref, 4, tmp_path)
    initial = ["--checkpoint.initial_load_path", ckpt(hsdp_ref, 8)]  # must lose against the resume point
    out = ok(run_train(job(tmp_path, *HSDP, *HF_EXPORT, *initial), nproc=4))
    assert f"initial_load_path {ckpt(hsdp_ref, 8)} is NOT loaded: a resume point exists" in out.stdout
    ref, got = losses(hsdp_ref), losses(tmp_path)
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == ref[s] for s in got), (ref, got)


def test_last_save_model_only_in_hf_and_initial_load(hsdp_ref, tmp_path):
    from safetensors.torch import load_file

    from torchtrain.models.llama3 import Llama3Args, Llama3StateDictAdapter

    final = ckpt(hsdp_ref, 8)
    meta = marker(final)
    assert meta["contents"] == ["model"] and meta["final"] and meta["dtype"] == "bfloat16"
    weights = {k[len("model."):]: v for k, v in load_all(final).items() if k.startswith("model.")}
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    hf_dir = os.path.join(final, "hf")
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1  # sharded past hf_max_shard_bytes
    hf = {}
    for name in set(weight_map.values()):
        hf.update(load_file(os.path.join(hf_dir, name)))
    adapter = Llama3StateDictAdapter(Llama3Args(**meta["model"]["args"]))
    assert len(hf) == len(weights)
    for key, value in weights.items():
        assert torch.equal(adapter.from_hf(key, hf[adapter.hf_key(key)]), value), key
    # An initial load from that checkpoint folder (its newest step: the bf16 export), in one process,
    # written back as a seed: the weights are the export's, upcast to float32 exactly.
    out = ok(run_train(job(tmp_path, "--checkpoint.initial_load_path", os.path.join(str(hsdp_ref), "checkpoint"),
                           "--checkpoint.create_seed_checkpoint")))
    assert f"initial load of model from {final}" in out.stdout and trained_steps(tmp_path) == 0
    seed = load_all(ckpt(tmp_path, 0))
    for key, value in weights.items():
        assert seed[f"model.{key}"].dtype == torch.float32 and torch.equal(seed[f"model.{key}"], value.float()), key


# ----------------------------------------------------------------------------------------------- resharding
@pytest.fixture(scope="module")
def fsdp4_ref(refs4):
    return refs4["fsdp4"]


@pytest.mark.parametrize("nproc, layout, dp", [
    (2, [], 2),
    (None, [], 1),  # one process without torchrun
    (4, TP2, 2),  # FSDP 2 x TP 2
    (2, PP2, 1),  # pipeline: 2 stages, the model cut in two
])
def test_reshard_fsdp4_checkpoint(fsdp4_ref, tmp_path, nproc, layout, dp):
    copy_step(fsdp4_ref, 4, tmp_path)
    out = ok(run_train(job(tmp_path, *GLOBAL_8, *layout), nproc=nproc))
    assert "is loaded under" in out.stdout and "resharded" in out.stdout
    assert f"data-parallel degree changed (4 -> {dp})" in out.stdout
    ref, got = losses(fsdp4_ref), losses(tmp_path)
    assert sorted(got) == [5, 6, 7, 8]
    for s in got:
        assert abs(got[s] - ref[s]) <= RTOL * abs(ref[s]), (s, ref[s], got[s])


# ----------------------------------------------------------------------------------------------- TP x PP
@pytest.fixture(scope="module")
def pp_tp_ref(refs4):
    return refs4["pp_tp"]


def test_exact_resume_pipeline_x_tensor_parallel(pp_tp_ref, tmp_path):
    copy_step(pp_tp_ref, 4, tmp_path)
    out = ok(run_train(job(tmp_path, *PP2, *TP2, "--checkpoint.interval", "4"), nproc=4))
    assert f"resumed from {ckpt(tmp_path, 4)}" in out.stdout
    ref, got = losses(pp_tp_ref), losses(tmp_path)
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == ref[s] for s in got), (ref, got)
