"""torchtrain.accelerate: Accelerate's API over the engine, for models and loops of the user's own.

Multi-process: one 4-rank torchrun launch (tests/scripts/accelerate_layouts.py) trains two models --
the example's text classifier and an MLP defined in the script -- as a plain one-process loop and
through the Accelerator under DDP 4, FSDP 4, FSDP 2 x TP 2 and HSDP 2 x 2, then resumes a save of
FSDP 2 x TP 2 in HSDP 2 x 2 and DDP 4; and the example script itself, under `python -m
torchtrain.launcher` (FSDP 2) and torchrun (DDP 2), against its single-device twin.

Tolerance 1e-4 per step (absolute on losses ~0.4-2.4): every layout computes the same global batch
in float32; only the order of floating-point sums differs (sharded matmuls under TP, gradients
averaged over ranks instead of one batch mean), a ~1e-7 relative effect that a few optimizer steps
amplify to at most ~1e-6 here. A wrong data split, a missing gradient average or a lost
optimizer/scheduler/loader state on resume changes losses by > 1e-2.

Bad input is checked in this process, before any process group exists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from torchtrain.accelerate import Accelerator, NotSupportedError
from torchtrain.accelerate.layout import parse_parallelism, resolve
from torchtrain.accelerate.model import default_units
from torchtrain.accelerate.tp_plan import resolve_plan
from torchtrain.config import ConfigError

TOL = 1e-4
EXAMPLE = os.path.join(REPO, "examples", "text_classifier")
STEPS = 5


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], **env) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=_env(**env))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", text, re.M)]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOL for x, y in zip(a, b))


# ----------------------------------------------------------------------------- one 4-rank launch
@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accelerate")
    out = folder / "losses.json"
    _run([sys.executable, "-m", "torchtrain.launcher", "--nproc_per_node=4", "--rdzv_backend=c10d",
          "--rdzv_endpoint=localhost:0", os.path.join(REPO, "tests", "scripts", "accelerate_layouts.py"), str(out),
          str(folder)])
    return json.loads(out.read_text())


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("model", ["classifier", "mlp"])
def test_every_layout_and_resume_match_one_process(layouts, model):
    ref = layouts[f"{model} reference"]
    table = "\n".join(f"{k:36s} " + " ".join(f"{x:.6f}" for x in v) for k, v in layouts.items() if k.startswith(model))
    print(table)
    assert len(ref) >= 6 and len(set(ref)) > 1, table
    for layout in ("ddp 4", "fsdp 4", "fsdp 2 x tp 2", "hsdp 2 x 2"):
        assert _close(layouts[f"{model} {layout}"], ref), f"{layout}\n{table}"
    resumed = ref[len(ref) - len(layouts[f"{model} resumed in ddp 4"]):]
    for layout in ("hsdp 2 x 2", "ddp 4"):
        assert _close(layouts[f"{model} resumed in {layout}"], resumed), f"resumed in {layout}\n{table}"


# ----------------------------------------------------------------------------- the example, launched
@pytest.fixture(scope="module")
def single_device_losses():
    return _losses(_run([sys.executable, os.path.join(EXAMPLE, "train_single.py"), "--steps", str(STEPS)]))


@pytest.mark.dist
def test_example_under_the_launcher_fsdp(single_device_losses):
    out = _run([sys.executable, "-m", "torchtrain.launcher", "--nproc_per_node=2", "--rdzv_backend=c10d",
                "--rdzv_endpoint=localhost:0", os.path.join(EXAMPLE, "train_distributed.py"), "--steps", str(STEPS)])
    assert len(single_device_losses) == STEPS
    assert _close(_losses(out), single_device_losses), out


@pytest.mark.dist
def test_example_under_torchrun_ddp(single_device_losses, tmp_path):
    job = tmp_path / "ddp.toml"
    job.write_text('[parallelism]\ndata_parallel_strategy = "ddp"\n')
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
                "--rdzv_endpoint=localhost:0", os.path.join(EXAMPLE, "train_distributed.py"), "--steps", str(STEPS)],
               TORCHTRAIN_PARALLELISM=str(job))
    assert _close(_losses(out), single_device_losses), out


def test_the_distributed_example_is_the_single_one_plus_the_accelerator():
    single = open(os.path.join(EXAMPLE, "train_single.py")).read().split('"""', 2)[2].splitlines()
    dist = open(os.path.join(EXAMPLE, "train_distributed.py")).read().split('"""', 2)[2].splitlines()
    added = [line.strip() for line in dist if line not in single]
    assert added == ["from torchtrain.accelerate import Accelerator", "accelerator = Accelerator()",
                     "model, optimizer, loader = accelerator.prepare(model, optimizer, loader)",
                     'accelerator.print(f"step {step} loss {accelerator.gather_for_metrics(loss).mean().item():.6f}")'
                     ], added
    assert len([line for line in single if line not in dist]) == 1  # the print it replaces


# ----------------------------------------------------------------------------- bad input, in process
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(4))
        self.head = nn.Linear(8, 3)


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_tp_plan_errors_name_the_pattern_and_module():
    with pytest.raises(ConfigError) as e:
        resolve_plan(Net(), {"blocks.*.attn": "colwise"}, 2)
    assert "'blocks.*.attn'" in _one_line(e) and "matches no module" in str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve_plan(Net(), {"blocks.*.1": "colwise"}, 2)
    assert "'blocks.0.1' is a LayerNorm" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        resolve_plan(Net(), {"head": "colwise"}, 2)
    assert "out_features 3, not divisible by tensor_parallel_degree 2" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        resolve_plan(Net(), {"head": "diagonal"}, 2)
    assert "unknown style 'diagonal'" in _one_line(e)
    plan = resolve_plan(Net(), {"blocks.*.0": "colwise", "blocks.[01].1": "sequence_parallel",
                                "head": ColwiseParallel()}, 1)
    assert sorted(plan) == ["blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1", "blocks.2.0", "blocks.3.0", "head"]
    assert type(plan["blocks.0.1"]).__name__ == "SequenceParallel" and type(plan["head"]) is ColwiseParallel


def test_unsupported_accelerate_methods_and_arguments():
    acc = object.__new__(Accelerator)  # (no process group needed to ask for a method)
    for name in ("gather", "reduce", "autocast", "free_memory", "register_for_checkpointing"):
        with pytest.raises(NotSupportedError) as e:
            getattr(acc, name)
        assert f"Accelerator.{name} is not supported" in _one_line(e)
    with pytest.raises(AttributeError):
        acc.no_such_thing
    with pytest.raises(NotSupportedError) as e:
        Accelerator(log_with="wandb")
    assert "Accelerator(log_with=...) is not supported" in _one_line(e)
    with pytest.raises(NotSupportedError) as e:
        Accelerator(colour="blue")
    assert "unknown argument 'colour'" in _one_line(e)


def test_layouts_that_do_not_fit_are_one_line_errors():
    with pytest.raises(ConfigError) as e:
        resolve(parse_parallelism({"tensor_parallel_degree": 3}), "no", 4, "cpu")
    assert "world size 4 is not divisible" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        resolve(parse_parallelism({"data_parallel_shard_degree": 3}), "no", 4, "cpu")
    assert "degrees multiply to 3" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        Accelerator(parallelism={"data_parallel_shard_degree": 2})  # this process is a world of one
    assert "world size is 1" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        parse_parallelism({"tensor_parallel_dgree": 2})
    assert "did you mean" in _one_line(e).lower()
    with pytest.raises(ConfigError) as e:
        resolve(parse_parallelism({"data_parallel_strategy": "zero1"}), "no", 2, "cpu")
    assert "zero1 is not offered" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        resolve(parse_parallelism(None), "fp16", 2, "cpu")
    assert "mixed_precision='fp16'" in _one_line(e)


def test_parallelism_from_a_toml_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 2\n')
    layout = resolve(parse_parallelism(str(job)), "no", 4, "cpu")
    assert layout.dims.hsdp_enabled and layout.fsdp


def test_default_fsdp_units_are_the_large_children():
    net = Net()
    assert default_units(net) == [*net.blocks, net.head]  # each block of the list, and the head
    tiny_head = nn.Module()
    tiny_head.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
    tiny_head.bias = nn.Linear(2, 1)
    assert len(default_units(tiny_head)) == 3
