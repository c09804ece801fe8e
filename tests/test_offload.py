"""[offload]: optimizer state and parameter shards in host memory or NVMe files (docs/offload.md).

Parity is bitwise (tolerance 0): the streamed step runs the same optimizer kernel on the same state,
bucket by bucket, and offloading only moves bytes, so any difference is a bug.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, TINY_JOB, run_train

from torchtrain.components.offload.store import FileStore, check_folder
from torchtrain.config import ConfigError
from torchtrain.launch_check import check

JOB = TINY_JOB + ["--training.steps", "4", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]


def losses(dump) -> list[tuple[int, float]]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def train(dump, nproc: int | None, *extra: str) -> list[tuple[int, float]]:
    out = run_train([*JOB, "--job.dump_folder", str(dump), *extra], nproc=nproc)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return losses(dump)


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_nvme_bitwise_then_resumed_with_cpu_tiers_exactly(tmp_path):
    """FSDP 2 ranks. Optimizer state and parameter shards on nvme, checkpoints every 2 steps: the losses
    are those without offload. Then the run again from step-2 with both tiers in cpu memory: the
    checkpoint held the state itself (the nvme scratch folder was emptied at the end), so the tier may
    change, and steps 3-4 repeat bitwise."""
    ref = train(tmp_path / "ref", 2)
    dump, nv = tmp_path / "offload", str(tmp_path / "nv")
    ckpt = ["--offload.bucket_mb", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    assert train(dump, 2, "--offload.optimizer", "nvme", "--offload.params", "nvme", "--offload.nvme_path", nv,
                 *ckpt) == ref
    assert not os.listdir(nv)
    shutil.rmtree(dump / "checkpoint" / "step-4")
    assert train(dump, 2, "--offload.optimizer", "cpu", "--offload.params", "cpu", *ckpt)[4:] == ref[2:]


def test_one_process_state_on_nvme_bitwise_and_rss_anon_drops_by_the_state(tmp_path):
    """One process per mode (benchmarks/offload.py; forward, backward, AdamW step): the losses with the
    state on nvme are bitwise those without, and anonymous memory drops by the state's size less the
    step's working buckets (2 x 4 MiB kept for reuse, 1 in use)."""
    def measure(mode: str) -> dict:
        cmd = [sys.executable, os.path.join(REPO, "benchmarks", "offload.py"), "--mode", mode, "--params-m", "8",
               "--steps", "2", "--bucket-mb", "4", "--folder", str(tmp_path)]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    base, nvme = measure("none"), measure("nvme")
    state = 8 * base["params"]
    assert nvme["losses"] == base["losses"]
    assert base["rss_anon"] - nvme["rss_anon"] >= state - 3 * 4 * 2**20 - 8 * 2**20, (base, nvme, state)
    assert nvme["read"] == state and nvme["written"] == 2 * state  # step 2 read step 1's state


def test_one_process_state_in_host_memory_bitwise():
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from torchtrain.components.offload.optimizer import StreamedOptimizer
    from torchtrain.components.offload.store import HostStore

    def run(offload: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        step = StreamedOptimizer(opt, HostStore(), "o", torch.device("cpu"), 64 * 8, ThreadPoolExecutor(2)).step \
            if offload else opt.step
        for _ in range(3):
            model(torch.randn(8, 16)).square().mean().backward()
            step()
            opt.zero_grad()
        assert not offload or all(len(s) == 1 for s in opt.state.values())  # only the step counts stay
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_file_store_round_trip_bf16_and_recycled_buffers(tmp_path):
    import torch

    store = FileStore(str(tmp_path / "s"), keep_bytes=1 << 20)
    t = torch.randn(100, 3).to(torch.bfloat16)
    store.put("a", t)
    back = store.get("a")
    assert torch.equal(back, t) and back.untyped_storage().resizable()
    store.recycle(back)
    assert store.get("a").data_ptr() == back.data_ptr()  # the recycled buffer served the read
    store.close()
    assert not os.path.exists(tmp_path / "s")


JOB2 = ["--nproc-per-node", "2", "--nnodes", "1", *TINY_JOB]


@pytest.mark.parametrize("extra, key, says", [
    (["--offload.optimizer", "nvme"], "offload.nvme_path", "needs a folder"),
    (["--offload.nvme_path", "/tmp/x"], "offload.nvme_path", "no tier is nvme"),
    (["--offload.params", "cpu", "--parallelism.data_parallel_strategy", "ddp"], "offload.params", "zero2/zero3"),
    (["--offload.params", "cpu", "--parallelism.tensor_parallel_degree", "2"], "offload.params", "tensor"),
    (["--offload.optimizer", "cpu", "--parallelism.data_parallel_strategy", "zero1"], "offload.optimizer", "zero1"),
    (["--offload.params", "nvme", "--offload.nvme_path", os.path.join(__file__, "nv")], "offload.nvme_path",
     "not a writable folder"),  # under a file
])
def test_offload_config_errors_before_launch(extra, key, says):
    with pytest.raises(ConfigError) as e:
        check([*JOB2, *extra])
    assert str(e.value).startswith(f"[{key}]") and says in str(e.value) and "\n" not in str(e.value)


def test_nvme_folder_without_the_room_needed(tmp_path):
    with pytest.raises(ValueError) as e:
        check_folder(str(tmp_path), 1 << 60)
    assert str(e.value).startswith("[offload.nvme_path]") and "GiB free but the offloaded state needs" in str(e.value)


PLAN_70B = ["--config", "train_configs/llama3_70b.toml", "--world-size", "4", "--gpu", "h100", "--tp", "1",
            "--training.local_batch_size", "1", "--no-trace"]


def test_planner_70b_on_4_h100_fits_with_offload_and_says_how_few_gpus_without(capsys):
    """The textbook case: Llama 3 70B does not fit 4 H100s (16 B/param of model state / 4 = 263 GiB per
    GPU); with parameters, gradients and optimizer state in host memory it does (1 TiB on a 2 TiB node),
    with the optimizer step on the CPU predicted slower; the fewest GPUs without offload is printed."""
    from torchtrain.plan import main

    assert main([*PLAN_70B, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["memory"]["fits"] is False and plain["offload"] is None
    fewest = plain["fewest_gpus"]["without_offload"]
    assert fewest > 4 and fewest % 8 == 0
    assert main([*PLAN_70B, "--offload-params", "cpu", "--offload-optimizer", "cpu", "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["memory"]["fits"] is True and off["offload"]["fits_node"] is True
    tiers = {r["component"]: r for r in off["offload"]["rows"]}
    assert tiers["optimizer state"]["gpu"] == 0 and tiers["optimizer state"]["cpu"] == pytest.approx(
        8 * off["model"]["num_params"] / 4, rel=0.01)
    assert off["offload"]["optimizer_s"] > off["offload"]["base_optimizer_s"]
    assert off["throughput"]["step_s"] > off["offload"]["step_s_without_offload"]
    # a node with too little host memory for it: refused
    assert main([*PLAN_70B, "--offload-params", "cpu", "--offload-optimizer", "cpu", "--host-memory-gib", "512"]) == 0
    assert "DOES NOT FIT the node" in capsys.readouterr().out
