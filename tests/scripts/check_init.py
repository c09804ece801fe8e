"""Under torchrun: initialise the tiny model under the requested layout and check every parameter's
full tensor is bitwise equal to a single-process initialisation with the same seed."""

import sys

import torch
import torch.distributed as dist
from layout_model import reference_and_sharded
from torch.distributed.tensor import DTensor

from torchtrain.config import parse_args
from torchtrain.trainer.preflight import preflight
from torchtrain.utils.process_exit import exit_process

cfg = parse_args(sys.argv[1:])
dist.init_process_group("gloo")
job = preflight(cfg, dist.get_world_size(), "cpu")
job.layout.dims.build_mesh("cpu")
job.model_args.max_seq_len = 32
reference, model = reference_and_sharded(job)

ref = dict(reference.named_parameters())
sharded = 0
for name, p in model.named_parameters():
    full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    sharded += isinstance(p, DTensor)
    assert torch.equal(full, ref[name].detach()), f"rank {dist.get_rank()}: {name} differs"
assert sharded > 0, "expected sharded parameters"
assert torch.equal(model.rope_cache, reference.rope_cache)
if dist.get_rank() == 0:
    print(f"INIT-OK {sharded} sharded parameters equal the single-process init")
dist.barrier()  # tear down together: see Trainer.close
dist.destroy_process_group()
exit_process(0)
