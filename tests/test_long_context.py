"""Long sequences: block-causal attention over packed documents and context parallelism.

Tolerances: block-causal logits vs each document alone 1e-5 (fp32; the same arithmetic on fewer keys,
only summation order differs, ~1e-6 observed); CP layouts vs one process 1e-4 relative loss per step
(the project's parity tolerance, see test_distributed.py; ~1e-7 observed); activation memory at CP 2
between 0.40 and 0.60 of CP 1 (each rank holds half of every sequence; the gathered keys/values and
the shared attention mask add a few percent)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY_JOB, ParitySuite, read_metrics, run_train
from test_model import build, tiny

from torchtrain.config import ConfigError, parse_args
from torchtrain.distributed.context_parallel import cp_indices, shard_batch
from torchtrain.models.common.attention import AttentionContext, AttentionCore, document_ids
from torchtrain.trainer.preflight import preflight

BLOCK = ["--model.attention_mask", "block_causal"]


def test_block_causal_packed_batch_equals_each_document_alone():
    model = build(tiny(attention_mask="block_causal", max_seq_len=64), seed=1)
    causal = build(tiny(max_seq_len=64), seed=1)
    lengths = [7, 20, 1, 12, 24]
    docs = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    tokens = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(tokens, positions=positions)
        start = 0
        for doc in docs:
            torch.testing.assert_close(packed[:, start:start + len(doc)], causal(doc[None]), rtol=1e-5, atol=1e-5)
            start += len(doc)
        # without positions (or with a causal mask) documents see each other: the logits differ
        assert not torch.allclose(model(tokens), packed, atol=1e-3)
        assert torch.equal(model(tokens), causal(tokens))


def test_flex_attention_masks_equal_dense_masks():
    """The FlexAttention path (CUDA) and the dense-mask SDPA path (CPU) build the same mask: compared on
    the forward, which FlexAttention also runs on CPU (eagerly)."""
    torch.manual_seed(0)
    b, s = 2, 64
    positions = torch.cat([torch.arange(24), torch.arange(40)]).expand(b, s).clone()
    positions[1] = torch.cat([torch.arange(10), torch.arange(54)])
    q, k, v = torch.randn(b, 4, s, 16), torch.randn(b, 2, s, 16), torch.randn(b, 2, s, 16)
    for mask in ("causal", "block_causal"):
        outs = []
        for backend in ("sdpa", "flex"):
            core = AttentionCore(mask, backend)
            ctx = AttentionContext(positions=positions)
            core.prepare(ctx, b, s, q.device)
            if mask == "causal":  # plain causal takes SDPA's is_causal; give both paths an explicit mask
                seq = torch.arange(s)
                ctx.mask = core.build_mask(b, seq, seq, None, None)
            outs.append(core(q, k, v, ctx))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    # a context-parallel mask: rank 1 of 2 (its head and tail chunks) against all keys in gathered order
    q_seq, k_seq = cp_indices(s, 2, 1), torch.cat([cp_indices(s, 2, r) for r in range(2)])
    docs = document_ids(positions)
    outs = [AttentionCore("block_causal", backend).attend(
        q[:, :, :s // 2], k, v, AttentionCore("block_causal", backend).build_mask(
            b, q_seq, k_seq, docs[:, q_seq], docs[:, k_seq])) for backend in ("sdpa", "flex")]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_attention_sinks_join_the_denominator_on_every_kernel():
    """Sinks under SDPA-side explicit scores and FlexAttention's log-sum-exp agree (forward: flex has no CPU
    backward), with block-causal and sliding-window masks; and they equal a softmax over the scores with one
    more column holding the sink logit (the definition), whose weight is dropped."""
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 24, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    sinks = torch.randn(h, generator=g)
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(b, -1)
    for mask, window in (("causal", None), ("block_causal", None), ("causal", 5)):
        outs = []
        for backend in ("sdpa", "flex"):
            core = AttentionCore(mask, backend, sinks=True)
            ctx = AttentionContext(positions=positions)
            core.prepare(ctx, b, s, q.device, (window,) if window else ())  # flex: a causal BlockMask too
            outs.append(core(q, k, v, ctx, window=window, sinks=sinks))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    seq = torch.arange(s)
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(seq[None, :] > seq[:, None], float("-inf"))
    column = sinks.view(1, h, 1, 1).expand(b, h, s, 1)
    weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    core = AttentionCore("causal", "sdpa", sinks=True)
    torch.testing.assert_close(core(q, k, v, AttentionContext(), sinks=sinks), weights @ v, rtol=1e-5, atol=1e-6)


def test_cp_split_without_load_balancing_is_contiguous():
    assert [cp_indices(64, 4, r, balanced=False).tolist() for r in range(4)] == \
        [list(range(16 * r, 16 * (r + 1))) for r in range(4)]
    with pytest.raises(ValueError, match="not divisible by context_parallel_degree = 4"):
        cp_indices(62, 4, 0, balanced=False)


def test_cp_split_is_load_balanced_and_covers_the_sequence():
    for cp in (1, 2, 4):
        held = [cp_indices(64, cp, r) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(64))
        work = {int((idx + 1).sum()) for idx in held}  # causal attention work ~ keys per query
        assert len(work) == 1  # every rank the same
    with pytest.raises(ValueError):
        cp_indices(60, 4, 0)
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():  # as a planner trace or dry run calls it: nothing of it reaches later real steps
        cp_indices(64, 2, 1)
    assert not isinstance(cp_indices(64, 2, 1), FakeTensor)
    batch = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 1}
    local = shard_batch(batch, 2, 1)
    assert local["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert local["seq_index"].tolist() == [[2, 3, 4, 5]] * 2 and torch.equal(local["labels"], local["input_ids"] + 1)


def _check(argv: list[str], world: int) -> None:
    preflight(parse_args(argv), world, "cpu")


def test_context_parallel_config_errors(monkeypatch):
    base = list(TINY_JOB) + ["--parallelism.context_parallel_degree", "2"]
    _check(base, 2)  # valid
    with pytest.raises(ConfigError, match=r"\[training.seq_len\] 62 is not divisible by 2 x context_parallel"):
        _check(base + ["--training.seq_len", "62"], 2)
    with pytest.raises(ConfigError, match=r"'ddp' cannot be combined with context parallelism"):
        _check(base + ["--parallelism.data_parallel_strategy", "ddp"], 2)
    with pytest.raises(ConfigError, match=r"\[training.seq_len\].*sequence parallelism"):
        _check(base + ["--training.seq_len", "4", "--parallelism.tensor_parallel_degree", "4"], 8)
    with pytest.raises(ConfigError, match=r"\[parallelism\] degrees multiply to 4 .*context_parallel_degree \(2\)"):
        _check(base + ["--parallelism.data_parallel_shard_degree", "2"], 2)
    with pytest.raises(ConfigError, match=r"\[validation.seq_len\] 30 is not divisible"):
        _check(base + ["--validation.enable", "--validation.seq_len", "30"], 2)
    monkeypatch.syspath_prepend(os.path.join(REPO, "tests", "plugins"))
    with pytest.raises(ConfigError, match="does not support context parallelism"):
        _check(["--job.custom_imports", "toy_mlp", "--model.name", "toy_mlp", "--model.flavor", "small",
                "--training.dataset", "synthetic", "--training.seq_len", "32",
                "--parallelism.context_parallel_degree", "2"], 2)


# ------------------------------------------------------------------------------------- multi-process
CP_LAYOUTS = ["cp2", "cp2_fsdp2", "cp2_tp2", "pp2_cp2"]
BLOCK_LAYOUTS = ["cp2", "cp2_tp2"]
STEPS = 5


@pytest.fixture(scope="module")
def cp_suite(tmp_path_factory):
    """The causal CP layouts and the block-causal variant's, in the same launches (one per process count)."""
    return ParitySuite(str(tmp_path_factory.mktemp("cp")), list(TINY_JOB) + ["--training.global_batch_size", "4"],
                       STEPS, layouts=[*CP_LAYOUTS, ("single", BLOCK), *[(spec, BLOCK) for spec in BLOCK_LAYOUTS]])


@pytest.mark.dist
def test_context_parallel_layouts_match_one_process(cp_suite):
    cp_suite.check(CP_LAYOUTS)


@pytest.mark.dist
def test_context_parallel_with_block_causal_masks(cp_suite):
    cp_suite.check(BLOCK_LAYOUTS, extra=BLOCK)


@pytest.mark.dist
def test_block_causal_logits_under_tensor_parallelism():
    cmd = [sys.executable, "-m", "torchtrain.launcher", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", os.path.join(REPO, "tests", "scripts", "block_causal_logits.py"),
           *TINY_JOB, *BLOCK, "--training.seq_len", "32", "--parallelism.tensor_parallel_degree", "2",
           "--parallelism.disable_loss_parallel", "true"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0 and "BLOCK-CAUSAL-OK tp 2" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.mark.dist
def test_activation_memory_halves_at_cp2(tmp_path):
    """Peak live activation bytes per rank (metrics.track_tensor_memory) on a 2,048-token sequence."""
    job = [*TINY_JOB, *BLOCK, "--model.dim", "128", "--training.seq_len", "2048", "--training.local_batch_size", "1",
           "--training.steps", "2", "--metrics.log_freq", "1", "--metrics.track_tensor_memory", "true"]
    act = {}
    for cp in (1, 2):
        dump = tmp_path / f"cp{cp}"
        out = run_train(job + ["--job.dump_folder", str(dump), "--parallelism.context_parallel_degree", str(cp)],
                        nproc=cp if cp > 1 else None)
        assert out.returncode == 0, out.stderr[-3000:]
        act[cp] = read_metrics(str(dump))[-1]["memory_tensor_breakdown_gib"]["activations"]
    ratio = act[2] / act[1]
    print(f"activations per rank: CP1 {act[1] * 1024:.1f} MiB, CP2 {act[2] * 1024:.1f} MiB, ratio {ratio:.2f}")
    assert 0.40 <= ratio <= 0.60, ratio


@pytest.mark.dist
def test_checkpoints_resume_exactly_with_cp_and_reshard_to_cp1(tmp_path):
    job = [*TINY_JOB, *BLOCK, "--training.steps", "6", "--metrics.log_freq", "1", "--debug.deterministic",
           "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "--checkpoint.interval", "3",
           "--training.global_batch_size", "4"]
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    full = tmp_path / "full"
    assert run_train(job + cp2 + ["--job.dump_folder", str(full)], nproc=4).returncode == 0
    reference = {r["step"]: r["loss"] for r in read_metrics(str(full))}
    for name, layout, nproc in (("again", cp2, 4), ("cp1", [], 2)):
        dump = tmp_path / name
        os.makedirs(dump / "checkpoint")
        os.system(f"cp -r {full}/checkpoint/step-3 {dump}/checkpoint/")
        out = run_train(job + layout + ["--job.dump_folder", str(dump)], nproc=nproc)
        assert out.returncode == 0, out.stderr[-3000:]
        resumed = {r["step"]: r["loss"] for r in read_metrics(str(dump))}
        assert sorted(resumed) == [4, 5, 6]
        for step, loss in resumed.items():
            if name == "again":  # same layout: bitwise
                assert loss == reference[step], (step, loss, reference[step])
            else:  # CP 2 x FSDP 2 -> FSDP 2 (CP 1): the parity tolerance
                assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])


# ------------------------------------------------------------------------------------- the planner
def test_planner_models_context_parallelism():
    from torchtrain.components.hardware import KNOWN_GPUS
    from torchtrain.planner.analytic import estimate_memory
    from torchtrain.planner.comm_time import kv_exchange_bytes
    from torchtrain.planner.core import load_job
    from torchtrain.planner.from_job import inputs_from_config
    from torchtrain.planner.search import enumerate_layouts
    from torchtrain.planner.step_time import estimate_step

    job = load_job(["--model.flavor", "8B", "--training.seq_len", "65536", "--training.local_batch_size", "1",
                    "--training.global_batch_size", "4"])
    base = inputs_from_config(job.cfg, job.args, 16, "cuda", KNOWN_GPUS["h100"], {"ac_mode": "full"})
    one, two = base.replace(cp=1, dp_shard=16, global_batch_size=16), base.replace(cp=2, dp_shard=8)
    acts = [next(r.bytes for r in estimate_memory(p).rows if r.name.startswith("activations")) for p in (one, two)]
    assert 0.45 < acts[1] / acts[0] < 0.6  # half the tokens per rank, plus the gathered keys and values
    a = base.args
    # per block and micro-batch: K and V of the other rank gathered in forward, again in the AC recompute,
    # and their gradients reduce-scattered in backward
    assert kv_exchange_bytes(two) == 3 * 2 * 32768 * a.kv_heads * a.head_dim * 2 * 1
    assert "context parallel" in estimate_step(two).comm_s
    cps = {k["cp"] for k in enumerate_layouts(base, ["full"], ["zero3"])}
    assert cps == {1, 2, 4, 8}  # 65536-token sequences: CP down to 8192 local tokens
    short = base.replace(seq_len=8192)
    assert {k["cp"] for k in enumerate_layouts(short, ["full"], ["zero3"])} == {1}
    assert {k["cp"] for k in enumerate_layouts(short, ["full"], ["zero3"], cp=2)} == {2}


@pytest.mark.dist
def test_context_parallel_with_a_mixture_of_experts_model(tmp_path):
    """Qwen3-MoE (both balancing modes on: the auxiliary loss's per-sequence expert counts are summed
    over the CP ranks) with block-causal masks: CP 2 x FSDP 2 matches one process."""
    moe = ["--model.name", "qwen3_moe", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "8",
           "--model.n_kv_heads", "4", "--model.head_dim", "16", "--model.vocab_size", "512", "--model.num_experts", "8",
           "--model.num_experts_per_tok", "2", "--model.moe_intermediate_size", "32",
           "--model.moe_load_balance_coeff", "0.01", "--training.dataset", "synthetic", "--training.seq_len", "64",
           "--training.local_batch_size", "2", "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2",
           "--optimizer.lr", "3e-3", *BLOCK]
    ParitySuite(str(tmp_path), moe, 10).check(["cp2_fsdp2"])
