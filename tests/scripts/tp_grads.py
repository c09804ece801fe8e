"""Under torchrun: for each job given (argument groups separated by `--next`), one forward/backward of the
model under the job's layout and of the same model in one process, same weights and tokens; prints one
line per job with the largest gradient difference of any parameter, relative to that gradient's largest
entry. Loss and grad-norm parity can hide a wrong gradient of a small parameter; this cannot."""

import sys

import torch
import torch.distributed as dist
from layout_model import reference_and_sharded
from torch.distributed.tensor import DTensor

from torchtrain.config import parse_args
from torchtrain.trainer.preflight import preflight
from torchtrain.utils.process_exit import exit_process


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def worst_gradient(argv: list[str]) -> tuple[float, str]:
    job = preflight(parse_args(argv), dist.get_world_size(), "cpu")
    job.layout.dims.build_mesh("cpu")
    reference, model = reference_and_sharded(job)
    tokens = torch.randint(0, job.model_args.vocab_size, (2, job.layout.batch.seq_len), generator=torch.Generator().manual_seed(0))
    reference(tokens).float().pow(2).mean().backward()
    full(model(tokens)).float().pow(2).mean().backward()
    expected = dict(reference.named_parameters())
    return max((((full(p.grad) - expected[n].grad).abs().max() / expected[n].grad.abs().max().clamp_min(1e-12)).item(), n)
               for n, p in model.named_parameters())


dist.init_process_group("gloo")
jobs, current = [], []
for a in sys.argv[1:] + ["--next"]:
    if a == "--next":
        jobs.append(current)
        current = []
    else:
        current.append(a)
for argv in jobs:
    label = argv[1]
    if argv[0] == "--sequence-first":  # the style torch before 2.13 gets for MLA's latent projections, on any torch
        import torchtrain.models.deepseek_v3.parallelize as deepseek_plan
        from torchtrain.models.common.tp import SequenceFirstLinear

        deepseek_plan.sequence_sharded_linear = SequenceFirstLinear
        argv, label = argv[1:], argv[2] + "_sequence_first"
    diff, name = worst_gradient(argv)
    if dist.get_rank() == 0:
        print(f"{label}: worst relative gradient difference {diff:.3e} ({name})", flush=True)
exit_process(0)
