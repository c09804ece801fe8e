"""Under torchrun: one training step of the tiny job; rank 0 prints its per-rank bytes of parameters
(at rest, and resident right after forward), gradients (after backward) and optimizer state, as
JSON on a line starting with STATE-BYTES."""

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from torchtrain.config import parse_args
from torchtrain.trainer.trainer import Trainer
from torchtrain.utils.process_exit import exit_process


def nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


trainer = Trainer(parse_args(sys.argv[1:]))
model, opts = trainer.model_parts[0], trainer.optimizers
seen: dict[str, int] = {"params_rest": sum(nbytes(p) for p in model.parameters())}

# FSDP2 registers unsharded parameters on the modules while they are gathered, so the parameters
# visible after the root's forward tell what stays resident until backward.
def after_forward(module, inputs, output) -> None:
    seen.setdefault("params_after_forward", sum(nbytes(p) for p in module.parameters()))


model.register_forward_hook(after_forward)
zero_grad = opts.zero_grad


def record_then_zero():
    seen["grads"] = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = [o.optim.state if hasattr(o, "optim") else o.state for o in opts]  # ZeRO-1 keeps a local optim
    seen["optimizer"] = sum(nbytes(v) for st in states for s in st.values() for v in s.values()
                            if torch.is_tensor(v) and v.dim() > 0)
    zero_grad()


opts.zero_grad = record_then_zero
it = iter(trainer.dataloader)
trainer.state.step = 1
trainer.train_step([next(it) for _ in range(trainer.batch.grad_accum_steps)])
if trainer.rank == 0:
    print("STATE-BYTES " + json.dumps(seen), flush=True)
trainer.close(finished=True)
exit_process(0)
