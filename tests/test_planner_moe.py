"""The planner on Qwen3 and Qwen3-MoE: activation formulas against the real blocks, expert sharding
and all-to-all arithmetic, analytic vs traced memory under expert parallelism, EP in `--search`, and
Qwen3-MoE 235B-A22B on 256 H100s planned within 4 GiB (its time: benchmarks/planner_scale.py).

Tolerances: the per-block activation formula is derived op by op and held exactly (as Llama 3's in
test_planner.py); analytic vs trace within 15% (test_planner.py's bound).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_planner import _inputs
from test_planner_scale import _plan

from torchtrain.components.hardware import KNOWN_GPUS
from torchtrain.models import block_memory
from torchtrain.models.contract import declare
from torchtrain.planner import analytic, comm_time, shapes
from torchtrain.planner.core import make_plan
from torchtrain.planner.search import search

MOE_JOB = ["--model.name", "qwen3_moe", "--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "8",
           "--model.n_kv_heads", "4", "--model.head_dim", "16", "--model.vocab_size", "512", "--model.num_experts", "8",
           "--model.moe_intermediate_size", "32", "--training.dataset", "synthetic", "--training.seq_len", "64",
           "--training.local_batch_size", "4", "--job.print_config", "false"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_activation_formula_matches_the_real_qwen3_blocks(family, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtrain.components.observability.tensor_memory import TensorMemoryTracker
    from torchtrain.models.common.attention import AttentionContext
    from torchtrain.models.qwen3 import Qwen3Args, Transformer
    from torchtrain.models.qwen3_moe import MoETransformer, Qwen3MoeArgs

    shape = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=32, vocab_size=256, max_seq_len=64)
    if family == "qwen3":  # n_heads x head_dim (256) != dim (128): the formula must use both
        cls, args = Transformer, Qwen3Args(**shape, hidden_dim=256)
    else:  # routing on fake tensors is taken as balanced (the planner's assumption)
        cls, args = MoETransformer, Qwen3MoeArgs(**shape, num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=64, moe_aux_loss_coeff=0.0)
    with FakeTensorMode():
        torch.set_default_dtype(dtype)
        try:
            model = cls(args).train()
        finally:
            torch.set_default_dtype(torch.float32)
        tracker = TensorMemoryTracker()
        tracker.register_model(model)
        stored = []
        with tracker:
            for n_blocks in (1, 2):
                x = torch.randn(2, 64, 128, dtype=dtype, requires_grad=True)
                base, h = tracker.current, x
                for block in list(model.layers.values())[:n_blocks]:
                    h = block(h, model.rope_cache, AttentionContext())
                stored.append(tracker.current - base)
                del h, x
    assert stored[1] - stored[0] == block_memory.act_per_token_per_block(declare(args), dtype.itemsize, 1) * 2 * 64


def test_expert_parallelism_shards_only_the_experts_and_costs_an_all_to_all():
    _, p = _inputs(8, base=MOE_JOB, gpu="h100", dp_shard=8)
    a, dense_state = p.model, {}
    for ep in (1, 2, 4, 8):
        q = p.replace(ep=ep)
        est = analytic.estimate_memory(q)
        units = shapes.unit_shapes(a, est.stages, 1, ep)
        experts = shapes.numel([s for n, sh in units if n.startswith("experts") for s in sh])
        others = shapes.numel([s for n, sh in units if not n.startswith("experts") for s in sh])
        assert experts * ep == a.n_layers * 3 * a.num_experts * a.dim * a.moe_intermediate_size
        params = next(r.bytes for r in est.rows if r.name.startswith("parameters"))
        # 4 B x (other params / dp_shard + the rank's experts / expert-FSDP degree), rows padded per tensor
        assert math.isclose(params, 4 * (others / 8 + experts / q.expert_fsdp), rel_tol=0.02)
        dense_state[ep] = params
        tokens = q.local_batch_size * q.seq_len
        expect = 4 * a.num_experts_per_tok * a.dim * 2 * (ep - 1) / ep * tokens * a.n_layers
        assert comm_time.expert_all_to_all_bytes(q) == pytest.approx(expect)
    assert dense_state[1] == pytest.approx(dense_state[8], rel=0.02)  # the same total: 1/8 of everything


DEEPSEEK_JOB = ["--model.name", "deepseek_v3", "--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4",
                "--model.vocab_size", "512", "--model.hidden_dim", "128", "--model.q_lora_rank", "32",
                "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16", "--model.qk_rope_head_dim", "8",
                "--model.v_head_dim", "16", "--model.moe_intermediate_size", "32", "--model.mtp_depth", "1",
                "--training.dataset", "synthetic", "--training.seq_len", "64", "--training.local_batch_size", "4",
                "--job.print_config", "false"]


PIPELINED = {"ep": 2, "pp": 2, "pp_microbatch_size": 1}


@pytest.mark.parametrize("base, world, flags", [(MOE_JOB, 2, {"ep": 2}), (MOE_JOB, 4, {"ep": 2}),
                                                (MOE_JOB, 4, {"ep": 2, "tp": 2}), (MOE_JOB, 4, PIPELINED),
                                                (DEEPSEEK_JOB, 2, {"ep": 2}), (DEEPSEEK_JOB, 4, PIPELINED)],
                         ids=["qwen3_moe-ep2", "qwen3_moe-ep2-dp2", "qwen3_moe-ep2-tp2", "qwen3_moe-pp2-ep2",
                              "deepseek_v3_mtp-ep2", "deepseek_v3_mtp-pp2-ep2"])
def test_moe_analytic_estimate_is_close_to_the_trace(base, world, flags):
    """Qwen3-MoE; and DeepSeek-V3: MLA's shapes, the dense first block, multi-token prediction on the
    last stage (a block, its projection and head, the embedding copy under PP), as the trace measures."""
    job, p = _inputs(world, base=base, **flags)
    plan = make_plan(job, p)
    assert plan.valid and not plan.blockers, plan.problems + plan.blockers
    for rank in plan.ranks:
        assert rank.trace.skipped is None, rank.trace.skipped
        assert abs(rank.analytic.peak - rank.traced_peak) <= 0.15 * rank.traced_peak, (rank.pp_rank, plan.ranks)


def test_search_includes_expert_parallel_layouts():
    job, p = _inputs(4, base=MOE_JOB, gpu="h100")
    result = search(job, p, ["none"], ["zero3"], verify=1)
    eps = {c.inputs.ep for c in result.ranked}
    assert {1, 2, 4} <= eps, eps
    assert result.ranked[0].plan is not None and result.ranked[0].plan.valid
    tp_without_ep = [c for c in result.rejected if c.inputs.tp > 1 and c.inputs.ep == 1]
    assert tp_without_ep and all("needs expert parallelism" in c.reason for c in tp_without_ep)


@pytest.mark.slow
def test_qwen3_moe_235b_on_256_h100_plans_within_4_gib(tmp_path):
    data, cpu_s, rss_gib = _plan(["--world-size", "256", "--gpu", "h100", "--model.name", "qwen3_moe",
                                  "--model.flavor", "235B-A22B", "--training.seq_len", "4096",
                                  "--training.local_batch_size", "4", "--pp", "2", "--tp", "2", "--ep", "8",
                                  "--ac", "full"], tmp_path)
    print(f"235B-A22B on 256 x H100: {cpu_s:.1f} s CPU, {rss_gib:.2f} GiB RSS")  # time: benchmarks/planner_scale.py
    assert rss_gib < 4
    assert data["valid"] and data["inputs"]["ep"] == 8
    assert round(data["model"]["num_params"] / 1e9) == 235 and round(data["model"]["num_active_params"] / 1e9) == 22
    assert data["throughput"]["expert_all_to_all_bytes"] > 0
    for rank in data["memory"]["ranks"]:
        traced = rank["traced"]["peak_bytes"]
        assert traced and abs(rank["analytic"]["peak_bytes"] - traced) <= 0.15 * traced


def test_the_trace_runs_the_experts_path_of_the_gpu_it_plans_for():
    """A bfloat16 MoE step traced for a Hopper GPU runs the experts as grouped GEMMs (a fixed number of operators
    per layer, whatever the number of experts), for an A100 (compute capability 8.0) as one loop iteration per
    expert (operators grow with the experts) -- the rule the trainer applies on the GPU (`grouped_mm_capable`)."""
    from torchtrain.config import ConfigError
    from torchtrain.models.common.experts import grouped_mm_capable
    from torchtrain.planner.core import resolve_gpu

    assert KNOWN_GPUS["h100"].compute_capability == (9, 0) and KNOWN_GPUS["a100"].compute_capability == (8, 0)
    assert grouped_mm_capable((9, 0), torch.bfloat16) and not grouped_mm_capable((8, 0), torch.bfloat16)
    assert not grouped_mm_capable((9, 0), torch.float32)
    assert resolve_gpu("a100", ["compute_capability=9.0"])[1].compute_capability == (9, 0)  # --device FIELD=VALUE
    with pytest.raises(ConfigError, match="write MAJOR.MINOR"):
        resolve_gpu("h100", ["compute_capability=9"])

    def kernels(gpu: str, experts: int) -> float:
        job, p = _inputs(1, job_args=["--model.num_experts", str(experts), "--training.mixed_precision_param",
                                      "bfloat16"], base=MOE_JOB, gpu=gpu)
        plan = make_plan(job, p)
        assert plan.ranks[0].trace is not None and plan.ranks[0].trace.skipped is None
        return plan.ranks[0].trace.counts.total("forward/backward", cls="kernel")

    grouped, looped = [kernels("h100", 4), kernels("h100", 8)], [kernels("a100", 4), kernels("a100", 8)]
    assert grouped[0] == grouped[1] and looped[1] > looped[0] and looped[0] > grouped[0], (grouped, looped)
