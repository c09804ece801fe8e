"""For the torchrun scripts beside this file: a job's model built twice with the same seed -- whole, in
one process, and under the job's layout by the trainer's applier (meta -> parallelised -> initialised)."""

import torch
from torch import nn

from torchtrain.distributed.parallelize import apply_parallelism
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.trainer.preflight import ResolvedJob


def reference_and_sharded(job: ResolvedJob, seed: int = 7) -> tuple[nn.Module, nn.Module]:
    """(the single-process model, this rank's parallelised model); the job's mesh must be built."""
    spec, args = job.model_spec, job.model_args
    reference = spec.model_cls(args)
    init_model_weights(reference, seed=seed)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = apply_parallelism(model, spec, job.layout)
    model.to_empty(device="cpu")
    init_model_weights(model, seed=seed)
    return reference, model
