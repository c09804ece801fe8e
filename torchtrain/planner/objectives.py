"""The post-training objectives of a job as the planner reads them: a `[dpo]` job's preference loss and its
reference (`Preference`), a `[grpo]` job's iteration (`Rollouts`). Plain data, read from the job and the Layout's
LoRA; what they cost is `preference.py`'s and `grpo.py`'s. `inputs.py` (PlanInputs) holds them, so they live
below both."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = {"copy": 'a frozen copy of the initial weights (dpo.reference = "model")',
         "adapters off": 'the model with its LoRA adapters off (dpo.reference = "model" with [lora]; no copy)',
         "precomputed": 'precomputed once before training (dpo.reference = "precomputed")',
         "none": "none (SimPO is reference-free)"}


@dataclass(frozen=True)
class Preference:
    """What a `[dpo]` job's step runs besides the trained model (module doc)."""

    loss_type: str
    reference: str
    """"copy", "adapters off", "precomputed" or "none" (`KINDS`)."""

    @property
    def live(self) -> bool:
        """A reference forward beside every micro-batch."""
        return self.reference in ("copy", "adapters off")


def read_preference(job, lora) -> Preference | None:
    """The `[dpo]` of `job` with the Layout's `lora` (None: no LoRA); None without a preference loss."""
    dpo = job.dpo
    if not dpo.enable:
        return None
    if not dpo.needs_reference:
        return Preference(dpo.loss_type, "none")
    if dpo.reference == "precomputed":
        return Preference(dpo.loss_type, "precomputed")
    return Preference(dpo.loss_type, "adapters off" if lora is not None else "copy")


@dataclass(frozen=True)
class Rollouts:
    """A `[grpo]` job's iteration as the planner reads it (`read_rollouts`)."""

    num_generations: int
    steps_per_generation: int
    num_iterations: int
    max_completion_length: int
    beta: float
    reference: str | None
    """"copy", "adapters off" (LoRA) or None (beta = 0: no reference)."""
    generator: str = "trainer"
    """`grpo.generator`: "trainer" (the model samples in its layout), "copy" (an unsharded copy on every rank) or
    "external" (a factory of the user's: `posttrain/generators.py`)."""
    reward_model: str = ""
    """`grpo.reward_model`: the checkpoint of a reward model scoring the rollouts ("" = none)."""
    max_staleness: int = 0
    """`grpo.max_staleness`: 1 = the next iteration sampled while this one trains (`posttrain/ahead.py`)."""
    old_logps: str = "sampler"
    """`grpo.old_logps`: "trainer" adds one no-grad forward of the model over the rollouts per iteration."""
    max_turns: int = 1
    """The model's turns per completion: `grpo.max_turns` with an environment, else 1."""
    generator_ranks: int = 0
    """`grpo.generator_ranks`: ranks apart that hold the copy and sample (`posttrain/generator_ranks.py`); 0 = none."""
    generator_tp: int = 1
    """`grpo.generator_tensor_parallel_degree`: the generator ranks one copy is split over."""
    generator_transport: str = "gloo"
    """`grpo.generator_transport`: how the weights reach the generator ranks (gloo: through host memory)."""

    @property
    def steps(self) -> int:
        """Optimizer steps per iteration, S mu."""
        return self.steps_per_generation * self.num_iterations


def read_rollouts(job, lora) -> Rollouts | None:
    """The `[grpo]` of `job` with the Layout's `lora` (None: no LoRA); None when GRPO is off."""
    g = job.grpo
    if not g.enable:
        return None
    ref = None if g.beta <= 0 else "adapters off" if lora is not None else "copy"
    return Rollouts(g.num_generations, g.steps_per_generation, g.num_iterations, g.max_completion_length, g.beta, ref,
                    g.generator if g.generator in ("trainer", "copy") else "external", g.reward_model,
                    g.max_staleness, g.old_logps, g.max_turns if g.environment else 1, g.generator_ranks,
                    g.generator_tensor_parallel_degree, g.generator_transport)
