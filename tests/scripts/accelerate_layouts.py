"""Run under torchrun with 4 ranks: torchtrain.accelerate against plain one-process loops.

Inside one process group: every rank first trains the reference (a plain PyTorch loop, no collectives),
then each layout through a new Accelerator, then a save_state in one layout resumed by load_state in
another. Two models: the example's text classifier (map-style shuffled data, an LR schedule) and an
MLP defined here (an iterable dataset, gradient accumulation, clipping, a TP plan of ParallelStyle
objects, built on the meta device). Writes the per-step losses of every run to argv[1] (JSON; rank 0).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "text_classifier"))
from classifier import Block, TextClassifier, make_dataset  # noqa: E402

from torchtrain.accelerate import Accelerator  # noqa: E402
from torchtrain.utils.process_exit import exit_process  # noqa: E402

STEPS, SAVE_AT = 6, 3
LAYOUTS = {
    "ddp 4": {"data_parallel_strategy": "ddp"},
    "fsdp 4": {},
    "fsdp 2 x tp 2": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
    "hsdp 2 x 2": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2},
}


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(3)
        for _ in range(96):
            x = torch.randn(16, generator=g)
            yield x, int(x[:4].sum() > 0) + 2 * int(x[4:8].sum() > 0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)


@torch.no_grad()
def init_mlp(model):
    g = torch.Generator().manual_seed(1)
    for _, p in sorted(model.named_parameters()):
        full = torch.randn(p.shape, generator=g) * 0.2
        p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)


def classifier(acc):
    torch.manual_seed(0)
    model = TextClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loader = DataLoader(make_dataset(64), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    if acc is not None:
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return model, opt, loader, sched


def mlp(acc):
    torch.manual_seed(0)
    if acc is None:
        model = MLP()
        init_mlp(model)
    else:
        with torch.device("meta"):
            model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(Stream(), batch_size=16)
    if acc is not None:
        model, opt, loader = acc.prepare(model, opt, loader)
    return model, opt, loader, None


def run(build, acc, steps, start=0, load=None, save=None):
    """Per-step losses of steps start..steps-1 (the global mean over the data-parallel ranks)."""
    model, opt, loader, sched = build(acc)
    accum = 2 if build is mlp else 1
    if load:
        acc.load_state(load)
    losses, step, micro = [], start, 0
    while step < steps:
        for x, y in loader:
            micro += 1
            if acc is None:
                loss = F.cross_entropy(model(x), y)
                (loss / accum).backward()
                if micro % accum == 0:
                    if build is mlp:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                    if sched is not None:
                        sched.step()
            else:
                with acc.accumulate(model):
                    loss = F.cross_entropy(model(x), y)
                    acc.backward(loss)
                    if acc.sync_gradients and build is mlp:
                        acc.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                    if sched is not None:
                        sched.step()
                loss = acc.gather_for_metrics(loss).mean()
            losses.append(loss.item())
            if micro % accum == 0:
                step += 1
                if save and step == SAVE_AT:
                    acc.save_state(save)
            if step == steps:
                break
    return losses


def main():
    out, folder = sys.argv[1], sys.argv[2]
    results = {}
    for name, build in (("classifier", classifier), ("mlp", mlp)):
        results[f"{name} reference"] = run(build, None, STEPS)
        for layout, par in LAYOUTS.items():
            extra = {"gradient_accumulation_steps": 2, "init_weights": init_mlp} if build is mlp else {}
            if build is mlp and "tp" in layout:
                extra["tp_plan"] = {"net.0": ColwiseParallel(), "net.2": RowwiseParallel()}
            if build is mlp and layout == "fsdp 4":
                extra["fsdp_units"] = [nn.Linear]
            if build is classifier and layout == "fsdp 4":
                extra["checkpoint_modules"] = [Block]
            acc = Accelerator(parallelism=par, **extra)
            save = os.path.join(folder, name) if layout == "fsdp 2 x tp 2" else None
            results[f"{name} {layout}"] = run(build, acc, STEPS, save=save)
        # resume the fsdp 2 x tp 2 save in other layouts
        for layout in ("hsdp 2 x 2", "ddp 4"):
            extra = {"gradient_accumulation_steps": 2, "init_weights": init_mlp} if build is mlp else {}
            acc = Accelerator(parallelism=LAYOUTS[layout], **extra)
            results[f"{name} resumed in {layout}"] = run(build, acc, STEPS, start=SAVE_AT,
                                                         load=os.path.join(folder, name))
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    exit_process(0)


if __name__ == "__main__":
    main()
