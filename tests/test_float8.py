"""Float8 training through torchao (docs/float8.md), proven on CPU with torchao's emulation.

* the config: torchtitan's [quantize.*] tables and `model.converters`, and every way float8 cannot
  run being one config error (the launch check prints one line);
* one process, FSDP 2 (float8 all-gather with precomputed scales) and FSDP 2 x TP 2 train the same
  model within a stated tolerance, and the FSDP run's checkpoint resumes in a job without float8;
* float8 stays within a stated band of the fp32 run over a few hundred steps (in-process).
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch
from conftest import REPO, TINY_JOB, assert_no_traceback

from torchtrain.config import ConfigError, parse_args, to_toml

pytest.importorskip("torchao")

EMULATED = ["--model.converters", "float8", "--quantize.linear.float8.emulate", "true"]


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def _layout(argv, world=1, device="cpu"):
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.trainer.preflight import preflight

    return preflight(parse_args(argv), world, device, tokenizer=build_tokenizer(None)).layout


# ----------------------------------------------------------------------------- config
def test_torchtitan_quantize_tables_load_and_round_trip(tmp_path):
    """torchtitan v0.2.2's job files carry these tables (MoE ones too) with the converter commented out."""
    path = _write(tmp_path, """
[model]
# converters = ["float8"]
[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output", "router.gate"]
[quantize.grouped_mm.float8]
fqns = ["experts"]
[quantize.linear.mx]
filter_fqns = ["output", "router.gate"]
[quantize.grouped_mm.mx]
fqns = ["experts"]
""")
    cfg = parse_args(["--job.config_file", path, "--quantize.linear.float8.emulate"])
    assert cfg.quantize.linear.float8.filter_fqns == ["output", "router.gate"]
    assert cfg.quantize.grouped_mm.float8.fqns == ["experts"] and cfg.quantize.linear.float8.emulate
    assert _layout(["--job.config_file", path]).float8 is None  # settings only: no converter named
    again = parse_args(["--job.config_file", _write(tmp_path, to_toml(cfg))])
    cfg.job.config_file = again.job.config_file = None
    assert again == cfg
    with pytest.raises(ConfigError, match=r"\[quantize.linear.float8\] unknown key 'emulat'; did you mean 'emulate'"):
        parse_args(["--quantize.linear.float8.emulat", "true"])


def test_the_405b_style_job_resolves_for_the_cluster():
    """torchtitan's 405B job: float8 with float8 all-gather and precomputed scales (checked without a GPU)."""
    float8 = _layout(["--job.config_file", f"{REPO}/train_configs/llama3_405b.toml", "--model.converters", "float8",
                      "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
                      "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true",
                      "--quantize.linear.float8.filter_fqns", "output"], world=16384, device="cuda").float8
    assert (float8.recipe, float8.fsdp_float8_all_gather, float8.precompute_scale) == ("tensorwise", True, True)
    assert float8.filter_fqns == ("output",) and not float8.emulate
    one_rank = _layout(TINY_JOB + EMULATED + ["--quantize.linear.float8.enable_fsdp_float8_all_gather", "true"]).float8
    assert not one_rank.fsdp_float8_all_gather  # nothing to all-gather on one rank


@pytest.mark.parametrize("argv, message", [
    (["--model.converters", "float8"], "float8 needs a CUDA GPU of compute capability 8.9\\+.*this run is on CPU"),
    (["--model.converters", "mx"], "MX formats"),
    (["--model.converters", "quantize.grouped_mm.float8"],
     r"^\[model.converters\] 'quantize.grouped_mm.float8': float8 grouped GEMMs .* this run is on cpu"),
    (["--model.converters", "flaot8"], "unknown converter 'flaot8'; did you mean 'float8'"),
    (["--model.converters", "float8,quantize.linear.float8"], "names a converter twice"),
    (EMULATED + ["--quantize.linear.float8.recipe_name", "rowwise",
                 "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true"], "tensorwise scaling only"),
])
def test_float8_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _layout(TINY_JOB + argv)


def test_float8_on_an_older_gpu_or_without_torchao_is_a_config_error(monkeypatch):
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(ConfigError, match="NVIDIA A100 has 8.0"):
        _layout(TINY_JOB + ["--model.converters", "float8"], device="cuda")
    assert _layout(TINY_JOB + EMULATED, device="cuda").float8.emulate  # emulation runs anywhere
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match="needs torchao"):
        _layout(TINY_JOB + EMULATED)


def test_float8_experts_resolve_on_hopper_only(monkeypatch):
    """The grouped-GEMM converter runs on CUDA 9.0+ (no CPU kernel, no emulation): checked with the
    capability mocked, so no float8 GEMM runs here."""
    experts = TINY_JOB + ["--model.converters", "quantize.grouped_mm.float8"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    with pytest.raises(ConfigError, match="need a GPU of compute capability 9.0\\+ .*NVIDIA L40S has 8.9"):
        _layout(experts + ["--quantize.grouped_mm.float8.fqns", "experts"], device="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(ConfigError, match=r"^\[quantize.grouped_mm.float8.fqns\] is empty"):
        _layout(experts, device="cuda")
    layout = _layout(experts + ["--quantize.grouped_mm.float8.fqns", "experts", "--model.converters",
                                "quantize.grouped_mm.float8,float8"], device="cuda")
    assert layout.float8_experts == ("experts",) and layout.float8.recipe == "tensorwise"
    assert _layout(TINY_JOB, device="cuda").float8_experts is None


def test_float8_experts_convert_the_selected_routed_experts_only():
    """`convert_experts` wraps the stacked weights of the routed-expert modules named by fqns (the
    shared experts' Linear layers stay), and converted experts take the `torch._grouped_mm` path."""
    from torch import nn
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    from torchtrain.models.common.experts import GroupedExperts, swiglu_looped
    from torchtrain.models.common.moe import FeedForward
    from torchtrain.models.converters.float8 import convert_experts, high_precision

    def model():
        layer = lambda: nn.ModuleDict({"moe": nn.ModuleDict({"experts": GroupedExperts(16, 32, 4),  # noqa: E731
                                                             "shared_experts": FeedForward(16, 32)})})
        return nn.ModuleDict({"layers": nn.ModuleList([layer(), layer()])})

    def wrapped(m):
        return sorted(n for n, p in m.named_parameters() if isinstance(p.data, Float8TrainingWeightWrapperTensor))

    m = model()
    assert convert_experts(m, ("experts",)) == 2
    assert wrapped(m) == [f"layers.{i}.moe.experts.{w}" for i in (0, 1) for w in ("w1", "w2", "w3")]
    assert m.layers[0].moe.experts.float8 and not hasattr(m.layers[0].moe.shared_experts, "float8")
    w1 = m.layers[0].moe.experts.w1
    assert type(high_precision(w1)) is torch.Tensor and high_precision(w1) is w1._data  # checkpoints: unwrapped
    m = model()
    assert convert_experts(m, ("layers.1.",)) == 1 and wrapped(m) == [f"layers.1.moe.experts.{w}"
                                                                       for w in ("w1", "w2", "w3")]
    with pytest.raises(ConfigError, match=r"\[quantize.grouped_mm.float8.fqns\] \['attention'\] names no routed"):
        convert_experts(model(), ("attention",))
    # the float8 path is `torch._grouped_mm` (run here unconverted, on torch's CPU kernel)
    experts = GroupedExperts(16, 32, 4)
    for w in (experts.w1, experts.w2, experts.w3):
        nn.init.normal_(w, std=0.1)
    experts.float8 = True
    x, counts = torch.randn(10, 16), torch.tensor([3, 0, 5, 2])
    calls = []
    real = torch._grouped_mm
    try:
        torch._grouped_mm = lambda *a, **k: calls.append(1) or real(*a, **k)
        out = experts.compute(x, counts)
    finally:
        torch._grouped_mm = real
    assert len(calls) == 3
    torch.testing.assert_close(out, swiglu_looped(x, counts, experts.w1, experts.w2, experts.w3))


@pytest.mark.parametrize("head", ["output", "lm_head"])
def test_the_output_head_stays_in_high_precision_unless_asked(head):
    """The model's output head (`models/heads.py`: `output`, or `lm_head` in transformers models) is not
    converted by default (its casts would run eagerly over the batch x vocabulary gradient); the blocks'
    layers are, and `convert_output_head` converts the head too. A block layer that happens to be named
    like a head (`layers.0.output`) is converted either way: only the top-level head is meant."""
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    from torchtrain.models.converters.float8 import convert_linears, resolve_float8

    def model():
        m = nn.Module()
        m.layers = nn.ModuleList([nn.ModuleDict({"w1": nn.Linear(32, 64), "output": nn.Linear(64, 32)})])
        setattr(m, head, nn.Linear(32, 128, bias=False))
        return m

    for convert_head in (False, True):
        job = parse_args(EMULATED + ["--quantize.linear.float8.convert_output_head", str(convert_head).lower()])
        plan = resolve_float8(job.model.converters, job.quantize, "cpu", fsdp_shards=False)
        m = model()
        assert convert_linears(m, plan) == 2 + convert_head
        assert isinstance(getattr(m, head), Float8Linear) is convert_head
        assert isinstance(m.layers[0]["output"], Float8Linear) and isinstance(m.layers[0]["w1"], Float8Linear)


def test_launch_check_prints_one_line(capsys):
    """float8 on the CPU (chosen explicitly: the check asks the job's device, which on a GPU machine is the
    GPU) is refused in one line."""
    from torchtrain.launch_check import main

    assert main(["--nproc-per-node", "2", *TINY_JOB, "--model.converters", "float8", "--training.device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchtrain: config error: [model.converters] float8 needs")
    assert_no_traceback(err)


# ----------------------------------------------------------------------------- training
@pytest.mark.slow
def test_float8_stays_within_a_band_of_fp32():
    """200 steps of a tiny Llama on a learnable stream (each sequence an arithmetic progression mod
    the vocabulary), fp32 vs float8 (emulated, tensorwise), same initial weights and data. Band: every
    25-step window's mean loss within 3% of fp32's. Measured: <= 0.7% (float8's e4m3 rounding,
    2^-4 relative, averages out over a layer's many products); the loss falls from 6.4 to 1.6, so a
    float8 path that broke training, or one that silently stayed in fp32 (checked separately: every
    Linear is converted, the output head included), would show."""
    from torchtrain.distributed.param_init import init_model_weights
    from torchtrain.models.converters.float8 import Float8Plan, convert_linears
    from torchtrain.models.registry import build_model_args, get_model_spec

    spec = get_model_spec("llama3")
    args = build_model_args(spec, "debugmodel", {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4,
                                                 "vocab_size": 512, "max_seq_len": 64})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and deterministic
    try:
        losses = {}
        for name in ("fp32", "float8"):
            with torch.device("meta"):
                model = spec.model_cls(args)
            if name == "float8":
                assert convert_linears(model, Float8Plan("tensorwise", emulate=True, fsdp_float8_all_gather=False,
                                                         precompute_scale=False, convert_output_head=True)) == 15
            model.to_empty(device="cpu")
            init_model_weights(model, seed=0)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            losses[name] = []
            for step in range(200):
                g = torch.Generator().manual_seed(step)
                start, stride = torch.randint(0, 512, (4, 1), generator=g), torch.randint(1, 8, (4, 1), generator=g)
                seq = (start + stride * torch.arange(65)) % 512
                loss = torch.nn.functional.cross_entropy(model(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.item())
    finally:
        torch.set_num_threads(threads)
    windows = [(statistics.mean(losses["fp32"][i:i + 25]), statistics.mean(losses["float8"][i:i + 25]))
               for i in range(0, 200, 25)]
    print("25-step mean losses (fp32, float8):", [(round(a, 4), round(b, 4)) for a, b in windows])
    assert all(abs(b - a) <= 0.03 * a for a, b in windows), windows
    assert windows[-1][1] < 0.4 * windows[0][1]  # it learned


@pytest.fixture(scope="module")
def float8_layouts(tmp_path_factory):
    """One process, FSDP 2 (float8 all-gather, precomputed scales, a checkpoint at the last step) and
    FSDP 2 x TP 2, all float8 (emulated) on the same job: the parity tool's runs. The output head is
    converted too (not the default), so every layout runs every Linear in float8, the vocabulary-parallel
    head under TP included."""
    from torchtrain.tools.parity import ParityCase, parse_layout, run_layout

    workdir = str(tmp_path_factory.mktemp("float8"))
    overrides = TINY_JOB + GLOBAL_BATCH + EMULATED + [
        "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
        "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true",
        "--quantize.linear.float8.convert_output_head", "true"]
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the one-process run too (torchrun sets it for the others)
    try:
        runs = {
            "single": run_layout(parse_layout("single"), None, STEPS, overrides, workdir),
            "fsdp2": run_layout(ParityCase("fsdp2", 2, ("--checkpoint.enable", "true", "--checkpoint.interval",
                                                    str(STEPS))), None, STEPS, overrides, workdir),
            "fsdp2_tp2": run_layout(parse_layout("fsdp2_tp2"), None, STEPS, overrides, workdir),
        }
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return workdir, runs


STEPS = 6
GLOBAL_BATCH = ["--training.global_batch_size", "4"]  # one process accumulates 2 micro-batches, the others 1
# Float8 runs of different layouts are not bitwise equal, unlike fp32 ones (1e-4): tensorwise scales
# of the activations come from each rank's own tokens (one process: the whole batch), so the e4m3
# rounding points differ. Measured over 10 steps: <= 1.3e-3 relative in loss and grad norm; 5e-3
# leaves room for other CPUs' rounding, and stays under the float8-vs-fp32 differences of these runs.
FLOAT8_LAYOUT_RTOL = 5e-3


@pytest.mark.dist
@pytest.mark.slow
def test_float8_layouts_train_the_same_model(float8_layouts):
    from torchtrain.tools.parity import compare, format_table

    _, runs = float8_layouts
    comps = [compare(runs["single"], runs[name], STEPS, FLOAT8_LAYOUT_RTOL) for name in ("fsdp2", "fsdp2_tp2")]
    table = format_table(runs["single"], comps, FLOAT8_LAYOUT_RTOL)
    print(table)
    assert all(c.ok for c in comps), table
    assert "float8 (tensorwise, emulated): 15 of 15 Linear layers converted" in runs["single"].log
    assert "emulated, float8 all-gather): 15 of 15" in runs["fsdp2"].log  # FSDP over 2 ranks
    assert "emulated, float8 all-gather): 15 of 15" in runs["fsdp2_tp2"].log


@pytest.mark.dist
@pytest.mark.slow
def test_float8_checkpoint_stays_high_precision_and_resumes_without_float8(float8_layouts):
    from conftest import read_metrics, run_train
    from torch.distributed.checkpoint import FileSystemReader

    workdir, runs = float8_layouts
    dump = os.path.join(workdir, "fsdp2")
    folder = os.path.join(dump, "checkpoint", f"step-{STEPS}")
    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    weights = {k: v for k, v in meta.items() if k.startswith("model.") and k.endswith("weight")}
    assert len(weights) >= 15 and {str(v.properties.dtype) for v in weights.values()} == {"torch.float32"}
    out = run_train(TINY_JOB + GLOBAL_BATCH + ["--training.steps", str(STEPS + 2), "--job.dump_folder", dump,
                                "--checkpoint.enable", "true", "--checkpoint.interval", "100",
                                "--metrics.log_freq", "1"], env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {folder}" in out.stdout + out.stderr
    resumed = [r for r in read_metrics(dump) if r["step"] > STEPS]
    before = runs["fsdp2"].records[-1]["loss"]
    assert [r["step"] for r in resumed][-2:] == [STEPS + 1, STEPS + 2]
    assert abs(resumed[-2]["loss"] - before) < 0.05 * before  # the trained weights came back
