"""The `[grpo]` objective (`trainer/objective.py`): its prompts, reward functions and rollout loader (which replaces
the job's data: `rollout.py`), its loss (`policy_loss.py`), and with beta > 0 the reference of the KL penalty
(`reference.py`), built, checked, checkpointed and set up before the first step.

    reference, checkpoint entry                   when
    --------------------------------------------  ------------------------------------------------
    none                                          grpo.beta = 0 (no KL penalty)
    the model itself, adapters off (LoRA)         [lora] enabled, beta > 0
    a frozen copy, `reference` weights            beta > 0; copied from the model at step 0
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from torchtrain.config import JobConfig
from torchtrain.config.fields import ConfigError
from torchtrain.data.prompts import Prompt, PromptFormatError, PromptStream, read_prompts
from torchtrain.data.tokenizer import Tokenizer, stop_ids
from torchtrain.distributed.layout import Layout
from torchtrain.posttrain.environments import Environments
from torchtrain.posttrain.generator_ranks import RemoteGenerator, generator_layout
from torchtrain.posttrain.generators import (
    CopyGenerator,
    GeneratorContext,
    TrainerGenerator,
    build_external,
)
from torchtrain.posttrain.policy_loss import PolicyLoss
from torchtrain.posttrain.reference import ReferenceModel, live_reference, start_reference
from torchtrain.posttrain.reward_model import load_reward_model
from torchtrain.posttrain.rewards import Rewards, import_function
from torchtrain.posttrain.rollout import RolloutLoader
from torchtrain.posttrain.sampling_layout import SamplerCopy, TrainedWeights, sampler_copy
from torchtrain.posttrain.timeline import TimelineWriter
from torchtrain.trainer.objective import Objective
from torchtrain.utils.logging import is_log_rank, logger


def load_prompts(cfg: JobConfig, tokenizer: Tokenizer) -> tuple[list[Prompt], Rewards]:
    """The job's prompts (rendered, lengths checked) and its reward functions, each called once on the first prompt;
    ConfigError naming the key and file:line (what the launch check runs, and the trainer before training)."""
    grpo, training = cfg.grpo, cfg.training
    if not training.dataset_path:
        raise ConfigError("[training.dataset_path] GRPO needs a JSONL file of prompts with reference answers")
    try:
        prompts, dropped = read_prompts(training.dataset_path, tokenizer, training.seq_len,
                                        grpo.max_completion_length, grpo.skip_long_prompts)
    except (PromptFormatError, OSError) as e:
        raise ConfigError(str(e) if str(e).startswith("[") else f"[training.dataset_path] {e}") from None
    if dropped and is_log_rank():
        logger.info("grpo: %d prompts longer than training.seq_len - grpo.max_completion_length dropped "
                    "(grpo.skip_long_prompts); %d left", dropped, len(prompts))
    rewards = Rewards(grpo.reward_funcs, grpo.reward_weights, grpo.format_pattern)
    rewards.check(prompts[0].answer, prompts[0].text, prompts[0].where)
    if grpo.environment:
        load_environments(grpo).check(prompts[0].text, prompts[0].answer, prompts[0].where)
    return prompts, rewards


def load_environments(grpo) -> Environments | None:
    """The job's environment factory (grpo.environment), None without one."""
    return Environments(import_function(grpo.environment, "grpo.environment"), grpo.environment) \
        if grpo.environment else None


class GrpoObjective(Objective):
    """The rollout loader (`loader`, the trainer's data), the policy loss and the reference (`reference`, None without
    a KL term)."""

    def __init__(self, cfg: JobConfig, spec, args, layout: Layout, device: torch.device, tokenizer: Tokenizer):
        grpo, training, batch = cfg.grpo, cfg.training, layout.batch
        if layout.dims.tp > 1 and grpo.generator == "trainer" and not spec.takes_cache(args):
            raise ConfigError(f"[grpo.generator] {cfg.model.name} (a model without a key/value cache) samples whole "
                              f"sequences at a time, which tensor parallelism's sequence shards do not allow: set "
                              f"grpo.generator = \"copy\"")
        if grpo.environment and grpo.generator in ("trainer", "copy") and not spec.takes_cache(args):
            raise ConfigError(f"[grpo.environment] {cfg.model.name} (a model without a key/value cache) samples prompts "
                              f"of one length at a time, and an episode's turns make them differ: use a family with a "
                              f"cache")
        prompts, rewards = load_prompts(cfg, tokenizer)
        stream = PromptStream(prompts, cfg.debug.seed, training.dataset_shuffle)
        self.stops, self.vocab_limit, self.layout = stop_ids(tokenizer, grpo.stop_token_ids), tokenizer.vocab_size, layout
        scorer = load_reward_model(grpo.reward_model, spec, args, layout, device, cfg.debug.seed, self.stops) \
            if grpo.reward_model else None
        self.loader = RolloutLoader(stream, grpo, rewards, tokenizer, training.seq_len, batch.local_batch_size,
                                    batch.grad_accum_steps, layout.data_rank, layout.data_degree, cfg.debug.seed,
                                    scorer, load_environments(grpo))
        self.loader.timeline = TimelineWriter(cfg.job.dump_folder if is_log_rank() else None)  # (`timeline.py`)
        self.copy: SamplerCopy | None = None
        self.pp_group = layout.dims.pp_mesh.get_group() if layout.dims.pp_enabled else None
        if grpo.generator_ranks and grpo.generator_tensor_parallel_degree > 1:  # the generators' own layout fits
            generator_layout(cfg, spec, args, device.type)
        self.remote = RemoteGenerator(cfg, spec, args, layout, device, self.pp_group) if grpo.generator_ranks else None
        if grpo.generator == "copy" and self.remote is None:  # (with generator ranks the copy is theirs)
            self.copy = SamplerCopy(sampler_copy(spec, args, layout.lora, device, layout.param_dtype),
                                    TrainedWeights([], self.pp_group))
        self.external = None  # a generator of the job's own, built before anything else starts (bad input: one line)
        if grpo.generator not in ("trainer", "copy"):
            self.context = GeneratorContext(TrainedWeights([], self.pp_group), spec, args, grpo, self.stops,
                                            self.vocab_limit, device, layout.param_dtype, layout.lora)
            self.external = build_external(import_function(grpo.generator, "grpo.generator"), grpo.generator,
                                           self.context)
        self.loss = PolicyLoss.for_layout(grpo, layout)
        self.reference: ReferenceModel | None = None
        if grpo.beta > 0:
            self.reference = live_reference(spec, args, layout, device, cfg.debug.seed, "grpo: KL penalty")
        logger.info("grpo: %d prompts; %d completions per prompt, %d prompts per step over all ranks, %d optimizer "
                    "steps per iteration (%d per batch of rollouts x %d passes); rewards: %s", len(prompts),
                    grpo.num_generations, self.loader.prompts_per_step * layout.data_degree,
                    grpo.steps_per_generation * grpo.num_iterations, grpo.steps_per_generation,
                    grpo.num_iterations, ", ".join(grpo.reward_funcs + (["a reward model"] if scorer else [])
                                                 + ([f"environment {grpo.environment}"] if grpo.environment else [])))

    def checkpoint_states(self) -> dict[str, Any]:
        """The checkpoint entry `reference`: the frozen copy's weights (nothing without one, or for LoRA)."""
        state = self.reference.checkpoint_state() if self.reference is not None else None
        return {"reference": state} if state is not None else {}

    def start(self, step_number: int, step, rows_per_batch: int = 0, heartbeat: Callable[[], None] | None = None) -> None:
        """After the checkpoint load: the reference takes the initial weights unless resumed with its own; the loader
        samples with the train step's model (`heartbeat`: tells the hang monitor sampling makes progress)."""
        if self.reference is not None:
            start_reference(self.reference, step_number, step.model_parts, "grpo")
        grpo = self.loader.grpo
        if self.external is not None:
            self.context.weights.parts, self.context.heartbeat, generator = step.model_parts, heartbeat, self.external
        elif self.remote is not None:
            self.remote.weights.parts, self.remote.heartbeat, generator = step.model_parts, heartbeat, self.remote
        elif self.copy is None:
            generator = TrainerGenerator(step, grpo, self.stops, self.vocab_limit, heartbeat)
        else:
            self.copy.weights.parts = step.model_parts
            generator = CopyGenerator(self.copy, grpo, self.stops, self.vocab_limit, self.layout.autocast_dtype,
                                      heartbeat)
        self.loader.attach(step, self.reference, generator, heartbeat)

    def record(self) -> dict[str, float]:
        """The latest iteration's rollout metrics (every rank calls it: one all-reduce)."""
        return self.loader.record()

    def close(self, finished: bool) -> None:
        """A run that finished tells its generator ranks to stop (one that failed is stopped by the launcher)."""
        if finished and self.remote is not None:
            self.remote.close()
