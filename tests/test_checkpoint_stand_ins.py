"""Selective "op" checkpointing in compiled blocks saves attention's rotated queries and keys (and, fused,
the values' copy) in place of the projections' outputs: the same saved bytes, nothing rotated again in
backward, the same numbers. Eager blocks, and attention with query/key norms (whose backward reads the
projection outputs), keep the plain policy; the planner reads the same declaration."""

from __future__ import annotations

import pytest
import torch
from conftest import PARTITIONER_ONLY

from torchtrain.distributed.activation_checkpoint import apply_activation_checkpointing, stand_ins
from torchtrain.models.contract import declare
from torchtrain.models.llama3 import Llama3Args
from torchtrain.models.llama3 import Transformer as Llama3
from torchtrain.models.qwen3 import Qwen3Args
from torchtrain.models.qwen3 import Transformer as Qwen3

ARGS = Llama3Args(dim=256, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=512, max_seq_len=64)
BATCH, SEQ = 2, 64
HQ, HKV = 256, 64  # query and key/value widths: 8 and 2 heads of 32


def _model(fused: bool, stand_ins: bool) -> tuple[Llama3, torch.Tensor]:
    """A bf16 llama3 model under selective "op" checkpointing, and a batch of tokens."""
    torch.manual_seed(0)
    model = Llama3(ARGS).to(torch.bfloat16)
    for block in model.layers.values():
        block.attention.fuse_qkv = fused
        block.attention.checkpoint_stand_ins = stand_ins
    apply_activation_checkpointing(model.layers, "selective", "op")
    return model, torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _run(fused: bool, compiled: bool, stand_ins: bool, backend: str = "inductor") -> tuple[list, list[torch.Tensor]]:
    """(shape and dtype of every tensor saved for backward in the second step's forward, the parameters'
    gradients of that step) for a bf16 llama3 block under selective "op" checkpointing."""
    model, tokens = _model(fused, stand_ins)
    if compiled:
        for block in model.layers.values():
            block.compile(fullgraph=True, backend=backend)
    model(tokens).float().square().mean().backward()  # (compiles)
    model.zero_grad()
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    out.float().square().mean().backward()
    return saved, [p.grad.clone() for p in model.parameters()]


def _nbytes(saved: list) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in saved)


def _changed(a: list, b: list) -> tuple[list, list]:
    """(what `a` saves that `b` does not, and the reverse), as multisets of (shape, dtype)."""
    rest_b, only_a = list(b), []
    for x in a:
        if x in rest_b:
            rest_b.remove(x)
        else:
            only_a.append(x)
    return sorted(only_a, key=str), sorted(rest_b, key=str)


@pytest.mark.slow
@pytest.mark.parametrize(("fused", "backend"), [(True, PARTITIONER_ONLY), (False, "inductor")],
                         ids=["fused_qkv", "three_projections"])
def test_compiled_blocks_save_the_rotated_inputs_for_the_same_bytes_and_numbers(fused, backend):
    """The saved set trades the projections' outputs for attention's inputs, byte for byte; the gradients
    are those of the plain policy (tolerance: a recomputation fused differently from the forward may round
    its bf16 cast differently, 2e-2 of the largest entry; observed: bitwise equal on torch 2.11 and 2.13).

    What a compiled block saves is decided by AOTAutograd's partitioner, before code generation: the fused
    case runs it with Inductor's decompositions and partitioner but without its C++ code generation
    (`aot_eager_decomp_partition`, the same saved set as Inductor's on torch 2.13, in a fraction of the compile
    time); the three-projection case runs Inductor whole."""
    saved, grads = _run(fused, compiled=True, stand_ins=True, backend=backend)
    plain, plain_grads = _run(fused, compiled=True, stand_ins=False, backend=backend)
    gained, dropped = _changed(saved, plain)
    bf16 = torch.bfloat16
    rotated = [((BATCH, SEQ, 8, 32), bf16), ((BATCH, SEQ, 2, 32), bf16)]
    if fused:  # the fused output (queries, keys, values) gives way to the rotated pair and the values' copy
        assert gained == sorted(rotated + [((BATCH, SEQ, HKV), bf16)], key=str)
        assert dropped == [((BATCH * SEQ, HQ + 2 * HKV), bf16)]
    else:  # the query and key projections' outputs give way to the rotated pair
        assert gained == sorted(rotated, key=str)
        assert dropped == sorted([((BATCH * SEQ, HQ), bf16), ((BATCH * SEQ, HKV), bf16)], key=str)
    assert _nbytes(saved) == _nbytes(plain)
    for g, ref in zip(grads, plain_grads):
        torch.testing.assert_close(g, ref, rtol=0, atol=2e-2 * ref.abs().max().item())


def _stored_eagerly(stand_ins: bool) -> int:
    """Bytes a bf16 llama3 model under selective "op" leaves stored after an eager forward (the checkpoint's
    own storage included, which saved-tensor hooks do not see)."""
    from torchtrain.components.observability.tensor_memory import TensorMemoryTracker

    model, tokens = _model(True, stand_ins)
    with TensorMemoryTracker() as tracker:
        before = tracker.current
        out = model(tokens)
        stored = tracker.current - before
    out.float().sum().backward()
    return stored


def test_eager_blocks_store_as_the_plain_policy():
    """Eagerly nothing is dropped after the fact, so a saved stand-in would be kept beside the output it
    comes from: the rule applies only while compiling, and an eager forward stores what the plain policy
    stores."""
    assert _stored_eagerly(True) == _stored_eagerly(False)


def test_attention_with_query_key_norms_declares_no_stand_ins():
    """Qwen3's query/key norms read the projections' outputs in backward: saving the rotated inputs too
    would add memory, so its attention does not declare them -- nor does its contract, which the planner
    reads."""
    qwen = Qwen3Args(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, hidden_dim=128,
                     max_seq_len=32)
    assert stand_ins(Qwen3(qwen).layers["0"]) == () and not declare(qwen).checkpoint_stand_ins
    llama = Llama3(ARGS).layers["0"]
    assert stand_ins(llama) == ("rotated",) and declare(ARGS).checkpoint_stand_ins
    llama.attention.fuse_qkv = True  # (as the applier sets it where the layout fuses)
    assert stand_ins(llama) == ("rotated", "values")


def test_the_planner_costs_no_rotation_in_the_recomputation():
    """Compiled "op": the recomputation is the block's memory-bound forward less RoPE on the queries and
    keys where the model declares stand-ins; eager blocks recompute the whole memory-bound forward."""
    from torchtrain.components.hardware import KNOWN_GPUS
    from torchtrain.models.block_memory import rope_bytes
    from torchtrain.planner.compute_time import block_time, memory_seconds
    from torchtrain.planner.core import load_job
    from torchtrain.planner.from_job import inputs_from_config

    dev = KNOWN_GPUS["h100"]
    blocks = {}
    for compiled in ("true", "false"):
        job = load_job(["--model.flavor", "1B", "--training.seq_len", "2048", "--training.local_batch_size", "8",
                        "--training.mixed_precision_param", "bfloat16", "--compile.enable", compiled,
                        "--activation_checkpoint.mode", "selective"])
        p = inputs_from_config(job.cfg, job.args, 1, "cuda", dev, {})
        assert p.model.checkpoint_stand_ins and (p.ac_mode, p.ac_option) == ("selective", "op")
        blocks[compiled] = (p, block_time(p, dev))
    p, block = blocks["true"]
    rope = memory_seconds(dev, rope_bytes(p.model, 2, compiled=True) * p.microbatch_tokens)
    assert rope > 0 and block.recompute == pytest.approx(block.mem_fwd - rope)
    _, eager = blocks["false"]
    assert eager.recompute == pytest.approx(eager.mem_fwd)
