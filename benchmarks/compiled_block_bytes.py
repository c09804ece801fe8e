"""Memory traffic of one compiled Llama block, forward and backward, by activation-checkpointing policy: the
CPU proxy of the GPU's memory-bound time.

    python benchmarks/compiled_block_bytes.py [--dim 2048] [--heads 32] [--kv-heads 8] [--ffn-multiplier 1.5]
                                               [--tokens 2048] [--three-projections] [--device cpu]
                                               [--repeats 0] [--json FILE]

A compiled block's element-wise work -- norms, RoPE, SwiGLU, residual adds, and what activation
checkpointing recomputes in backward -- is bound by memory on a GPU: its time is the bytes its kernels
read and write over the memory bandwidth. Inductor makes the same decisions for either device about
which tensors backward keeps and which operations it recomputes, and its scheduler knows the bytes each
fused kernel reads and writes; summed over the kernels it generates for the CPU, they estimate the GPU's
memory-bound traffic without a GPU (fusion differs in detail between Triton and C++ code). GEMMs and
attention (library kernels) are not counted. Bytes scale with the tokens; weight-sized traffic (the
fused q/k/v projection's weight concatenation) is spread over them, so use thousands of tokens.

Rows (bf16, one block, its forward and backward graphs):

* `none`: no checkpointing (the partitioner alone decides what to keep);
* `op, plain`: selective "op" saving every matmul and attention output (as attention with query/key
  norms gets it);
* `op`: selective "op" as the trainer applies it to this attention, with its checkpoint stand-ins
  (`distributed/activation_checkpoint.py`: the rotated queries and keys saved instead of the projections'
  outputs).

The last column turns the difference to `op, plain` into milliseconds a step of the 1B job of the GPU
kit (16 blocks, batch 8 x 2048 tokens) at the H100's effective bandwidth from `components/hardware.py`.
On a GPU (`--device cuda`, Triton kernels: the bytes of the GPU's own fusion) with `--repeats N`, each row
also times the block's forward and backward (the median of N, after the compiling one); `--tokens 16384`
is one block of the kit's batch-8 step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch._dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch._inductor.scheduler as scheduler

from torchtrain.components.hardware import KNOWN_GPUS
from torchtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from torchtrain.models.llama3 import Llama3Args, Transformer

KIT_TOKENS_PER_STEP, KIT_BLOCKS = 8 * 2048, 16


class KernelBytes:
    """Sums the bytes Inductor's scheduler gives each kernel it generates (library kernels excluded)."""

    def __init__(self):
        self.bytes = self.kernels = 0
        original = scheduler.Scheduler._codegen

        def counting(sched, nodes):
            for node in nodes:
                if not isinstance(node, (scheduler.ExternKernelSchedulerNode, scheduler.NopKernelSchedulerNode)):
                    self.bytes += node.get_read_write_buffers_sizes()
                    self.kernels += 1
            return original(sched, nodes)

        scheduler.Scheduler._codegen = counting

    def take(self) -> tuple[int, int]:
        out = self.bytes, self.kernels
        self.bytes = self.kernels = 0
        return out


def measure(args: argparse.Namespace, mode: str, stand_ins: bool, counter: KernelBytes) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model_args = Llama3Args(dim=args.dim, n_layers=1, n_heads=args.heads, n_kv_heads=args.kv_heads, vocab_size=256,
                            ffn_dim_multiplier=args.ffn_multiplier, max_seq_len=args.tokens)
    model = Transformer(model_args).to(device=args.device, dtype=torch.bfloat16)
    block = model.layers["0"]
    block.attention.fuse_qkv = not args.three_projections
    block.attention.checkpoint_stand_ins = stand_ins
    apply_activation_checkpointing(model.layers, mode, "op")
    model.layers["0"].compile(fullgraph=True)  # the block as checkpointing wrapped it
    tokens = torch.randint(0, model_args.vocab_size, (1, args.tokens), device=args.device)
    counter.take()
    out = model(tokens)  # (only the block is compiled: its kernels are the ones counted)
    fwd, fwd_kernels = counter.take()
    out.float().square().mean().backward()
    bwd, bwd_kernels = counter.take()
    seconds = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        _sync(args.device)
        start = time.perf_counter()
        model(tokens).float().square().mean().backward()
        _sync(args.device)
        seconds.append(time.perf_counter() - start)
    t = args.tokens
    return {"forward_bytes_per_token": fwd / t, "backward_bytes_per_token": bwd / t,
            "kernels": [fwd_kernels, bwd_kernels], "seconds": statistics.median(seconds) if seconds else None}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn-multiplier", type=float, default=1.5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--three-projections", action="store_true", help="q, k, v as three GEMMs (not fused)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (Triton kernels)")
    parser.add_argument("--repeats", type=int, default=0, help="time N forward+backward passes a row (median)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    inductor_config.fx_graph_cache = False  # every row generates its kernels (they are what is counted)
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = False
    counter = KernelBytes()
    rows = {"none": measure(args, "none", False, counter),
            "op, plain": measure(args, "selective", False, counter),
            "op": measure(args, "selective", True, counter)}
    h100 = KNOWN_GPUS["h100"]
    bandwidth = h100.hbm_tbps * 1e12 * h100.memory_efficiency
    plain = rows["op, plain"]
    print(f"torch {torch.__version__} on {args.device}; one Llama block dim {args.dim}, {args.heads} heads "
          f"({args.kv_heads} key/value), {args.tokens} tokens, bf16, q/k/v "
          f"{'three GEMMs' if args.three_projections else 'fused'}; the model's embedding and head run eagerly")
    print(f"{'policy':<10} {'forward B/token':>16} {'backward B/token':>17} {'total':>9} {'kernels':>9} "
          f"{'vs op, plain (1B b8 on H100)':>30}{'  fwd+bwd s' if args.repeats else ''}")
    for name, row in rows.items():
        total = row["forward_bytes_per_token"] + row["backward_bytes_per_token"]
        diff = total - plain["forward_bytes_per_token"] - plain["backward_bytes_per_token"]
        row["ms_vs_plain_kit_1b_b8_h100"] = diff * KIT_TOKENS_PER_STEP * KIT_BLOCKS / bandwidth * 1e3
        print(f"{name:<10} {row['forward_bytes_per_token']:>16,.0f} {row['backward_bytes_per_token']:>17,.0f} "
              f"{total:>9,.0f} {'%d + %d' % tuple(row['kernels']):>9} {row['ms_vs_plain_kit_1b_b8_h100']:>+27.1f} ms"
              + (f"  {row['seconds']:.5f}" if row["seconds"] is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
