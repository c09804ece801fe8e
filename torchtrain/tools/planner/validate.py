"""Is a layout valid, and can this torchtrain build run it?

Two separate questions:

* `layout_problems`: the layout itself is impossible or ill-formed whatever the build: degrees do
  not multiply to the world size, heads not divisible by the tensor-parallel degree, fewer layers than
  pipeline stages, a global batch that is not a multiple of local batch x dp, ... A search rejects
  such layouts with the reason.
* `runnable_problems`: does the trainer accept the job? It builds the real JobConfig with the
  layout's overrides and runs the trainer's own start-up checks (`torchtrain.preflight`: degrees,
  batch, model arguments and the model's parallel checks, feature combinations, the pipeline plan).
"""

from __future__ import annotations

from typing import Any

from torchtrain.config import ConfigError, JobConfig, parse_args
from torchtrain.tools.planner.inputs import AC_MODES, RESHARD, STRATEGIES, PlanInputs, config_overrides


def layout_problems(p: PlanInputs) -> list[str]:
    a, out = p.args, []
    if p.dp_replicate * p.dp_shard * p.tp * p.pp != p.world_size:
        product = p.dp_replicate * p.dp_shard * p.tp * p.pp
        out.append(f"degrees multiply to {product}, not the world size {p.world_size}")
    if min(p.dp_replicate, p.dp_shard, p.tp, p.pp) < 1:
        out.append("every parallel degree must be >= 1")
    if p.strategy not in STRATEGIES:
        out.append(f"unknown data-parallel strategy {p.strategy!r} (one of {', '.join(STRATEGIES)})")
    if p.ac_mode not in AC_MODES:
        out.append(f"unknown activation checkpointing mode {p.ac_mode!r} (one of {', '.join(AC_MODES)})")
    if p.ac_mode == "selective" and p.ac_option != "op" and not (p.ac_option.isdigit() and int(p.ac_option) >= 1):
        out.append(f"selective_ac_option must be 'op' or an integer >= 1, got {p.ac_option!r}")
    if p.strategy == "zero2" and p.reshard_after_forward == "always":
        out.append("fsdp_reshard_after_forward 'always' contradicts zero2 (which keeps gathered parameters)")
    if p.reshard_after_forward not in RESHARD:
        out.append(f"fsdp_reshard_after_forward must be one of {', '.join(RESHARD)}")
    if p.cpu_offload and not p.sharded:
        out.append("CPU offload needs an FSDP strategy (zero2/zero3: FSDP2's CPUOffloadPolicy)")
    if p.tp > 1:
        for name, value in (("n_heads", a.n_heads), ("n_kv_heads", a.kv_heads), ("dim", a.dim),
                            ("ffn hidden size", a.ffn_hidden_dim)):
            if value % p.tp:
                out.append(f"{name} {value} is not divisible by tensor_parallel_degree {p.tp}")
    if p.pp > 1:  # the split, schedule and micro-batch rules are the trainer's: see pipeline.pipeline_of
        stages = p.pp * p.pp_stages_per_rank
        if a.n_layers < stages:
            out.append(f"{a.n_layers} layers cannot fill {stages} pipeline stages")
        if getattr(a, "tie_word_embeddings", False):
            out.append("tied embeddings live on the first and the last stage: not supported with pipeline parallelism")
    per_micro = p.local_batch_size * p.dp
    if p.global_batch_size % per_micro:
        out.append(f"global batch {p.global_batch_size} is not a multiple of local batch {p.local_batch_size} x "
                   f"dp {p.dp} = {per_micro}")
    return out


def build_job_config(p: PlanInputs, base_argv: list[str]) -> tuple[JobConfig, list[str]]:
    """The job config selecting this layout with the keys this build has, and the keys it lacks."""
    overrides, missing = config_overrides(p, parse_args(base_argv))
    return parse_args(base_argv + overrides), [f"needs config key {k} (feature not in this build)" for k in missing]


def runnable_problems(p: PlanInputs, base_argv: list[str], tokenizer: Any) -> list[str]:
    """The trainer's own start-up checks (`torchtrain.preflight`) applied to this layout on its target
    device type ([] = the trainer would start it)."""
    from torchtrain.preflight import preflight

    try:
        cfg, problems = build_job_config(p, base_argv)
        preflight(cfg, p.world_size, p.device_type, tokenizer)
    except ConfigError as e:
        return [str(e)]
    return problems
