"""ATen operations per training step, torchtrain against torchtitan: the CPU proxy of a GPU's launch count.

    python benchmarks/op_count.py [--layers 6] [--dtype bfloat16] [--ac none] [--seq-len 256] [--batch 2]
                                  [--optimizer-impl fused] [--top 25] [--json FILE]

A small model's GPU step is bound by the host: every operation the step dispatches costs host time
(Python, the dispatcher, a kernel launch), whatever its size. Counting the operations of one steady
training step on the CPU (torch.profiler, every `aten::` event, nested ones included) therefore
predicts the launch-bound part of the GPU step without a GPU; the counts do not depend on the batch or
sequence size, so a small one is used. The GPU's count differs where a CPU kernel is a composition
and the CUDA one fused (RMSNorm: `aten::_fused_rms_norm` is one CUDA kernel, a dozen operations on
the CPU -- the same on both sides here, since both use it).

Each side runs in a fresh process, one rank, on the same model shape (Llama 3 "debugmodel": dim 256,
16 heads, vocabulary 2048; `--layers` blocks), after two warm-up steps:

* torchtrain: its Trainer's step (`TrainStep`), with the job's own layout for one rank;
* torchtitan (when `import torchtitan` works; otherwise its row says why): the model from its llama3
  registry with its SDPA attention (the same causal computation; its language-model default is
  FlexAttention over document masks), its one-GPU path (no FSDP; torch.autocast to `--dtype`), its
  debug job's loss, gradient clipping, optimizer container and LR schedule -- what its `train_step`
  runs. Activation checkpointing is compared with `--ac none` only (torchtitan's is applied by its
  parallelize function).

Both use `--optimizer-impl` (fused by default: what both run on CUDA).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

import torch

VOCAB = 2048


def _profile(step) -> collections.Counter:
    """aten events of one call of `step` (nested ones included)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def torchtrain_ops(args) -> collections.Counter:
    from torchtrain.config import parse_args
    from torchtrain.distributed.utils import free_port
    from torchtrain.trainer.trainer import Trainer

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory() as dump:
        trainer = Trainer(parse_args([
            "--model.flavor", "debugmodel", "--model.n_layers", str(args.layers), "--model.vocab_size", str(VOCAB),
            "--training.dataset", "synthetic", "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch), "--training.steps", "10",
            "--training.mixed_precision_param", args.dtype, "--optimizer.implementation", args.optimizer_impl,
            "--activation_checkpoint.mode", args.ac, "--lr_scheduler.warmup_steps", "2",
            "--metrics.enable_tensorboard", "false", "--job.print_config", "false", "--job.dump_folder", dump]))
        try:
            batches = iter(trainer.dataloader)

            def step():
                trainer.state.step += 1
                trainer.train_step([next(batches)], trainer.hooks)

            for _ in range(2):
                step()
            return _profile(step)
        finally:
            trainer.close()


def torchtitan_ops(args) -> collections.Counter:
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel()
    model_cfg = cfg.model_spec.model
    model_cfg.layers = model_cfg.layers[: args.layers]
    for layer in model_cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.optimizer.implementation = args.optimizer_impl
    with torch.device("meta"):
        model = model_cfg.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    if hasattr(loss_fn, "set_lm_head"):  # its debug job's chunked loss applies the output layer itself
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = cfg.optimizer.build(model_parts=[model])
    schedulers = cfg.lr_scheduler.build(optimizers=optimizers, training_steps=10)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)

    def step():
        optimizers.zero_grad()
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=generator)
        labels = tokens[:, 1:]
        valid = (labels != -100).sum()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            pred = model(tokens[:, :-1])
            loss, _ = loss_fn(pred, labels, valid)
            del pred
            loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        schedulers.step()

    for _ in range(2):
        step()
    return _profile(step)


def _side(name: str, argv: list[str]) -> dict:
    """One side's counts from a fresh process ({"error": ...} when it cannot run)."""
    out = subprocess.run([sys.executable, __file__, *argv, "--only", name], capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("OPS ")]
    if out.returncode or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:200]}
    return json.loads(lines[-1][4:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--ac", default="none", choices=["none", "selective", "full"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--optimizer-impl", default="fused", choices=["fused", "foreach"])
    p.add_argument("--top", type=int, default=25, help="operations with the largest differences to list")
    p.add_argument("--json", help="also write the counts here")
    p.add_argument("--only", choices=["torchtrain", "torchtitan"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.only:
        torch.manual_seed(0)
        counts = torchtrain_ops(args) if args.only == "torchtrain" else torchtitan_ops(args)
        print("OPS " + json.dumps(dict(counts)))
        return 0
    argv = [a for a in sys.argv[1:] if a != "--json" and not (args.json and a == args.json)]
    sides = {"torchtrain": _side("torchtrain", argv)}
    if args.ac == "none":
        sides["torchtitan"] = _side("torchtitan", argv)
    print(f"torch {torch.__version__} | Llama 3 debug shape, {args.layers} layers | {args.dtype} | AC {args.ac} | "
          f"optimizer {args.optimizer_impl} | one process, one steady step (aten events, nested included)")
    totals = {}
    for name, counts in sides.items():
        if "error" in counts:
            print(f"{name:11s}: not run ({counts['error']})")
        else:
            totals[name] = sum(counts.values())
            print(f"{name:11s}: {totals[name]:6d} aten ops")
    if len(totals) == 2:
        ours, theirs = sides["torchtrain"], sides["torchtitan"]
        print(f"ratio      : {totals['torchtrain'] / totals['torchtitan']:.3f} (torchtrain / torchtitan)")
        diff = sorted(set(ours) | set(theirs), key=lambda k: -abs(ours.get(k, 0) - theirs.get(k, 0)))
        print(f"\n{'operation':34s} {'torchtrain':>10s} {'torchtitan':>10s}")
        for name in diff[: args.top]:
            print(f"{name:34s} {ours.get(name, 0):10d} {theirs.get(name, 0):10d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "counts": sides}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
