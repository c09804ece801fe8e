"""The Llama 3 pipeline split: which modules each pipeline stage holds.

Stages run in model order: the first holds `tok_embeddings`, the last `norm` and `output`, and the
transformer blocks are split evenly in between. `first_less` / `last_less` take blocks away from the
first / last stage to balance the embedding and the output head (which, with a large vocabulary,
cost about as much as a block or two).
"""

from __future__ import annotations

from torchtrain.config.fields import ConfigError
from torchtrain.models.llama3.args import Llama3Args


def llama_stage_modules(args: Llama3Args, num_stages: int, first_less: int = 0, last_less: int = 0
                        ) -> list[list[str]]:
    units = args.n_layers + first_less + last_less
    if units % num_stages or units // num_stages < 1:
        raise ConfigError(
            f"[model.n_layers] {args.n_layers} blocks (+ {first_less} first-stage and {last_less} last-stage "
            f"less layers = {units}) cannot be split evenly into {num_stages} pipeline stages; change "
            f"parallelism.pipeline_parallel_degree / pipeline_parallel_layers_per_stage, or the "
            f"pipeline_parallel_first/last_stage_less_layers"
        )
    per = units // num_stages
    counts = [per] * num_stages
    counts[0] -= first_less
    counts[-1] -= last_less
    if min(counts) < 0 or (num_stages > 1 and min(counts[1:-1] or [1]) < 1):
        raise ConfigError(
            f"[parallelism.pipeline_parallel_first_stage_less_layers] {first_less} / last {last_less} leave a "
            f"stage with a negative or zero number of blocks ({counts}); use smaller values"
        )
    stages, layer = [], 0
    for i, count in enumerate(counts):
        names = ["tok_embeddings"] if i == 0 else []
        names += [f"layers.{layer + j}" for j in range(count)]
        layer += count
        if i == num_stages - 1:
            names += ["norm", "output"]
        stages.append(names)
    return stages
