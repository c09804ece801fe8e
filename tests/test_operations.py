"""Operations end to end under real torchrun + gloo: multi-node launches (run_train.sh and the SLURM
script with its preemption/requeue path), determinism, profiling traces, the phase breakdown and
validation (against an offline evaluation, and under pipeline x tensor parallelism).

Every run trains the same tiny job (8 steps, global batch 4) with one thread per process, so that
runs are comparable bit for bit:

* two "nodes" (two torchrun agents on this machine, one process each) vs one node with two processes:
  BITWISE equal losses. The processes get the same global ranks (node-major), read the same data and
  run the same gloo collectives over loopback in the same order with the same thread count; how
  they were launched cannot change a single floating-point operation (the parity tolerance 1e-4
  would hide a wrongly assigned rank only if it happened not to matter, so we ask for equality);
* two deterministic runs of the same job: BITWISE equal (the acceptance criterion);
* validation loss vs an offline single-process evaluation of the checkpointed weights on the same
  batches: relative 1e-5 (fp32; only the grouping of the float32 per-batch sums differs: two ranks
  x 2 sequences vs one batch of 4, ~1e-7);
* validation under PP 2 x TP 2 vs FSDP 2: relative 1e-4, the training-parity tolerance (the weights
  themselves differ by float summation order after 4 steps; observed ~1e-7);
* phase breakdown: the named phases add up to the step time within 10% (the remainder is logging).

About 85 s on 2 CPU cores: 7 launches (5 of 2 processes, 1 of 4, the SLURM script twice).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import stat
import subprocess

import pytest
import torch
from conftest import FAULT_INJECTION, REPO, TINY_JOB, read_metrics, wait_for_pid_file

from torchtrain.distributed.utils import free_port

pytestmark = pytest.mark.dist
STEPS = 8
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "LOG_RANK": "0", "PYTHONUNBUFFERED": "1",
       "CONFIG_FILE": "train_configs/debug_model.toml"}


def job(dump, *extra: str) -> list[str]:
    return [*TINY_JOB, "--training.steps", str(STEPS), "--training.global_batch_size", "4", "--metrics.log_freq", "1",
            "--debug.deterministic", "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump),
            "--validation.enable", "--validation.freq", "4", "--validation.steps", "3",
            "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0", *extra]


PROFILED = ("--profiling.enable_profiling", "--profiling.profile_freq", "4", "--profiling.profiler_warmup", "1",
            "--profiling.enable_phase_timing", "--profiling.enable_memory_snapshot")


def launch(args: list[str], **env: str) -> subprocess.Popen:
    full = dict(os.environ, **ENV, **env)
    full.pop("RANK", None)
    return subprocess.Popen(["./run_train.sh", *args], cwd=REPO, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-5000:]
    return out


def losses(dump) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r.get("validation_loss")) for r in read_metrics(str(dump))]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """NGPU=2 ./run_train.sh, with profiling, phase timing, validation and checkpoints."""
    dump = tmp_path_factory.mktemp("one_node")
    return dump, finish(launch(job(dump, *PROFILED), NGPU="2"))


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """NNODES=2 ./run_train.sh on two 'nodes' (static rendezvous on loopback), one process each."""
    dump = tmp_path_factory.mktemp("two_nodes")
    env = dict(NGPU="1", NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    nodes = [launch(job(dump), NODE_RANK=str(rank), **env) for rank in (1, 0)]
    return dump, [finish(p) for p in nodes]


def test_two_nodes_train_together_and_match_one_node(one_node, two_nodes):
    (ref, _), (dump, (_, node0)) = one_node, two_nodes
    assert "launch: 2 nodes x 1 processes (rendezvous 127.0.0.1:" in node0
    assert "2 processes: dp_shard 2" in node0
    assert len(losses(dump)) == STEPS and losses(dump) == losses(ref)


def test_deterministic_runs_are_bitwise_identical(one_node, tmp_path):
    ref, _ = one_node
    finish(launch(job(tmp_path, *PROFILED), NGPU="2"))
    first, second = read_metrics(str(ref)), read_metrics(str(tmp_path))
    keys = ("step", "loss", "grad_norm", "lr", "validation_loss")
    assert [[r.get(k) for k in keys] for r in first] == [[r.get(k) for k in keys] for r in second]


def test_run_train_needs_a_rendezvous_for_several_nodes():
    out = subprocess.run(["./run_train.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, NNODES="2", NGPU="1"))
    assert out.returncode == 2 and "needs either NODE_RANK and MASTER_ADDR" in out.stderr
    # a range of nodes (losing one without a relaunch: tests/test_elastic.py) needs the c10d rendezvous
    out = subprocess.run(["./run_train.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, NNODES="1:2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", NGPU="1"))
    assert out.returncode == 2 and "NNODES=1:2 (a range of nodes) needs RDZV_ENDPOINT" in out.stderr


# ------------------------------------------------------------------------------------- profiling
def test_profiler_traces_per_rank_and_step(one_node):
    dump, out = one_node
    for step in (4, 8):
        for rank in (0, 1):
            with open(os.path.join(str(dump), "profile_traces", f"iteration_{step}", f"rank{rank}_trace.json")) as f:
                names = {e.get("name") for e in json.load(f)["traceEvents"]}
            assert f"ProfilerStep#{step}" in names and f"ProfilerStep#{step - 1}" not in names
            assert {"phase:forward_backward", "phase:optimizer", "aten::mm", "aten::_foreach_norm"} <= names
    assert sorted(os.listdir(os.path.join(str(dump), "profile_traces"))) == ["iteration_4", "iteration_8"]
    # CPU run: the snapshot request is answered with a note, not a crash and not a file
    assert "memory snapshots record the CUDA caching allocator" in out
    assert not os.path.exists(os.path.join(str(dump), "memory_snapshot"))


def test_phase_breakdown_sums_to_step_time(one_node):
    records = read_metrics(str(one_node[0]))
    named = ("data", "forward_backward", "optimizer", "validation", "checkpoint", "profiler")
    for r in records:
        assert all(r[f"phase_{p}_s"] >= 0 for p in named) and r["phase_forward_backward_s"] > 0
        assert math.isclose(sum(r[f"phase_{p}_s"] for p in (*named, "other")), r["step_time_s"], rel_tol=0.02)
    # Over the run (one step per record), the named phases explain the step time within 10%.
    total = sum(r["step_time_s"] for r in records)
    phases = sum(r[f"phase_{p}_s"] for r in records for p in named)
    assert abs(phases - total) <= 0.10 * total, (phases, total)
    assert all(r["phase_validation_s"] > 0 for r in records if r["step"] in (4, 8))
    assert all(r["phase_checkpoint_s"] > 0 for r in records if r["step"] in (5,))  # step 4's save, next interval


# ------------------------------------------------------------------------------------- validation
def offline_validation_loss(checkpoint: str, batches: int, batch_size: int) -> float:
    """Load the checkpoint's weights into one unsharded model, evaluate the validation batches."""
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F

    from torchtrain.config import parse_args
    from torchtrain.data.build import resolve_sources
    from torchtrain.data.dataset import WindowDataset
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.models.registry import build_model_args, get_model_spec

    cfg = parse_args(["--job.config_file", os.path.join(REPO, ENV["CONFIG_FILE"]), *TINY_JOB])
    spec, tokenizer = get_model_spec("llama3"), build_tokenizer(None)
    args = build_model_args(spec, cfg.model.flavor, cfg.model.overrides)
    args.update_from_job(cfg.training.seq_len, tokenizer)
    model = spec.model_cls(args).eval()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict(state["model"])
    sources = resolve_sources("synthetic", None, [], "text", None, None, tokenizer, "validation", cfg.debug.seed)
    data = WindowDataset(sources, cfg.training.seq_len, shuffle=False)  # the split in stream order
    ce, tokens = 0.0, 0
    with torch.no_grad():
        for b in range(batches):
            samples = [data[g] for g in range(b * batch_size, (b + 1) * batch_size)]
            inputs, labels = (torch.stack([s[k] for s in samples]) for k in ("input_ids", "labels"))
            ce += F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), reduction="sum").item()
            tokens += labels.numel()
    return ce / tokens


def test_validation_loss_equals_offline_evaluation(one_node):
    dump, out = one_node
    records = {r["step"]: r for r in read_metrics(str(dump))}
    assert sorted(s for s, r in records.items() if "validation_loss" in r) == [4, 8]
    for step in (4, 8):
        r = records[step]
        assert r["validation_tokens"] == 3 * 4 * 64 and r["validation_batches"] == 3
        assert math.isclose(r["validation_perplexity"], math.exp(r["validation_loss"]), rel_tol=1e-12)
        offline = offline_validation_loss(os.path.join(str(dump), "checkpoint", f"step-{step}"), 3, 4)
        assert math.isclose(r["validation_loss"], offline, rel_tol=1e-5), (step, r["validation_loss"], offline)
    assert records[8]["validation_loss"] < records[8]["loss"] + 1.0  # a sane value, not a scaled one
    assert "step     4 | validation loss" in out


def test_validation_under_pipeline_and_tensor_parallelism(one_node, tmp_path):
    dump, _ = one_node
    args = job(tmp_path, "--parallelism.pipeline_parallel_degree", "2",
               "--parallelism.tensor_parallel_degree", "2", "--validation.local_batch_size", "4",
               "--checkpoint.enable", "false")
    finish(launch(args, NGPU="4"))
    ref = {r["step"]: r for r in read_metrics(str(dump))}
    got = {r["step"]: r for r in read_metrics(str(tmp_path))}
    for step in (4, 8):  # same job, same LR schedule: only the layout differs
        assert got[step]["validation_tokens"] == ref[step]["validation_tokens"]
        assert math.isclose(got[step]["validation_loss"], ref[step]["validation_loss"], rel_tol=1e-4), step


# ------------------------------------------------------------------------------------- SLURM
SHIMS = {
    # Stand-ins for the SLURM commands the script calls, recording each call in $SHIM_DIR/calls.
    "scontrol": """#!/bin/bash
echo "scontrol $*" >> "$SHIM_DIR/calls"
[ "$1 $2" = "show hostnames" ] && echo localhost
exit 0
""",
    # srun: start the command once per node on this machine (the node's task), record the task pids.
    "srun": """#!/bin/bash
echo "srun $*" >> "$SHIM_DIR/calls"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
printf '%s\\n' "${pids[@]}" > "$SHIM_DIR/task_pids"
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
""",
    # scancel --signal=SIG: the signal reaches each node's task (its main process) only.
    "scancel": """#!/bin/bash
echo "scancel $*" >> "$SHIM_DIR/calls"
sig=${1#--signal=}
for p in $(cat "$SHIM_DIR/task_pids"); do kill -s "$sig" "$p"; done
""",
}


def shim_folder(tmp_path):
    shims = tmp_path / "shims"
    shims.mkdir()
    for name, text in SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(stat.S_IRWXU)
    return shims


def slurm_job(shims, dump, restart: int, *extra: str, **env: str) -> subprocess.Popen:
    full = dict(os.environ, **ENV, PATH=f"{shims}:{os.environ['PATH']}", SHIM_DIR=str(shims), SLURM_JOB_ID="4242",
                SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=REPO, GPUS_PER_NODE="1",
                SLURM_RESTART_COUNT=str(restart), RDZV_PORT=str(free_port()), **env)
    full.pop("RANK", None)
    full["TORCHTRAIN_TEST_NO_ZYGOTE"] = "1"  # the script signals the launcher's process tree: real processes
    return subprocess.Popen(["bash", "scripts/multinode_trainer.slurm", *job(dump, *FAULT_INJECTION, *extra)], cwd=REPO,
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_slurm_script_requeues_without_the_hosts_a_replica_check_named(tmp_path):
    """A node listed in fault.sdc_exclude_file refuses to start (exit 6, before any worker): the batch script
    reads the file's path from the job (launch_check --print) and requeues the job excluding every host it lists."""
    shims = shim_folder(tmp_path)
    listed = tmp_path / "sdc_hosts.txt"
    listed.write_text(f"gpu-node-17\n{socket.gethostname()}\n")
    proc = slurm_job(shims, tmp_path / "run", 0, "--fault.sdc_exclude_file", str(listed))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 6, out[-3000:]
    assert f"this host ({socket.gethostname()}) is listed in fault.sdc_exclude_file" in out, out[-3000:]
    assert f"requeueing job 4242 without the hosts {listed} lists" in out, out[-3000:]
    calls = (shims / "calls").read_text().splitlines()
    assert calls[-2:] == [f"scontrol update JobId=4242 ExcludeNodeList=gpu-node-17,{socket.gethostname()}",
                          "scontrol requeue 4242"], calls
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").rglob("metrics.jsonl"))


def test_slurm_script_preempts_requeues_and_resumes_exactly(one_node, tmp_path):
    shims = shim_folder(tmp_path)
    dump = tmp_path / "run"
    # Rank 0 parks after step 3 until a preemption signal arrives (test hook), so SIGUSR1 lands at a
    # known step: the batch script gets it (as from --signal=B:USR1@120), passes it on with scancel,
    # each node's shell forwards it to its training process, all ranks save step-3 and exit 0, and
    # the script requeues the job. Restarts within the allocation are on: a preemption's exit 0 uses none.
    proc = slurm_job(shims, dump, 0, "--fault.max_restarts", "2", TORCHTRAIN_TEST_WAIT_FOR_SIGNAL="3:0")
    wait_for_pid_file(proc, dump / "test_waiting_rank0.pid", "rank 0 never reached step 3")
    os.kill(proc.pid, signal.SIGUSR1)
    out = finish(proc)
    assert "SIGUSR1 (time limit ahead)" in out and "checkpoint step-3 saved, exiting" in out
    assert "requeueing job 4242" in out and "restarting the workers" not in out
    calls = (shims / "calls").read_text()
    assert "scancel --signal=USR1 4242" in calls and "scontrol requeue 4242" in calls
    assert [r["step"] for r in read_metrics(str(dump))] == [1, 2, 3]
    (shims / "calls").write_text("")
    out = finish(slurm_job(shims, dump, 1))  # the requeued job
    assert "restart 1" in out and "training continues at step 4" in out
    assert "scontrol requeue" not in (shims / "calls").read_text()
    ref = {r[0]: r for r in losses(one_node[0])}
    got = {r[0]: r for r in losses(dump)}  # steps 1-3 of the first job, 4-8 of the requeued one
    assert sorted(got) == list(range(1, STEPS + 1)) and all(got[s] == ref[s] for s in got), (ref, got)


def test_launch_check_prints_a_job_key_or_names_a_wrong_one(capsys):
    from torchtrain.launch_check import main

    assert main(["--nproc-per-node", "1", "--print", "fault.sdc_exclude_file", "--fault.sdc_exclude_file", "h.txt"]) == 0
    assert main(["--nproc-per-node", "1", "--print", "fault.sdc_exclude_file"]) == 0
    assert capsys.readouterr().out == "h.txt\n\n"  # unset: an empty line
    assert main(["--nproc-per-node", "1", "--print", "fault.no_such_key"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--print fault.no_such_key: fault has no key 'no_such_key'" in err[0], err
