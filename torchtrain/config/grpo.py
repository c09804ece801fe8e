"""Config section [grpo]: reinforcement learning with verifiable rewards on the model's own samples
(docs/post_training.md). Key names follow TRL's GRPOConfig where the meaning is the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from torchtrain.config.fields import ConfigError, Ge, Gt
from torchtrain.config.post_training import check_loss_section

BUILTIN_REWARDS = ("exact", "numeric", "format")


@dataclass
class Grpo:
    enable: bool = False
    """Train on prompts with reference answers (`training.dataset = "prompts"`): every iteration the model
    samples `num_generations` completions of each of its prompts, reward functions score them, and the
    clipped policy-gradient objective with group-normalised advantages trains on them."""

    num_generations: Annotated[int, Ge(2)] = 8
    """Completions sampled per prompt (G): the group whose rewards are normalised into advantages."""

    steps_per_generation: Annotated[int, Ge(1)] = 1
    """Optimizer steps over one batch of rollouts: each rank samples steps_per_generation x the rows of its
    step (local_batch_size x gradient accumulation) completions per iteration, num_generations per prompt."""

    num_iterations: Annotated[int, Ge(1)] = 1
    """Passes over each batch of rollouts (mu): an iteration is steps_per_generation x num_iterations
    optimizer steps. Above 1 (or with several steps per generation) the importance ratio moves away from 1
    and the clipping matters."""

    max_completion_length: Annotated[int, Ge(1)] = 64
    """Most tokens sampled per completion; each prompt plus this must fit in training.seq_len."""

    overlong_buffer_len: Annotated[int, Ge(0)] = 0
    """DAPO's overlong reward shaping: a completion longer than max_completion_length - overlong_buffer_len tokens
    has its reward lowered in proportion, by up to overlong_penalty_factor at max_completion_length tokens (one
    that did not stop in time); 0: off."""

    overlong_penalty_factor: Annotated[float, Ge(0)] = 1.0
    """The reward a completion of max_completion_length tokens loses (overlong_buffer_len)."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: an iteration keeps only the groups whose rewards differ (a group whose completions
    all score the same has advantage 0 and teaches nothing), sampling the next prompts in further rounds until every
    rank has its batch of such groups; surplus groups are dropped (grpo/groups_dropped, grpo/sampling_rounds)."""

    max_sampling_rounds: Annotated[int, Ge(1)] = 4
    """The most sampling rounds of an iteration under dynamic_sampling; still short after the last, agreeing groups
    fill the batch (their advantage 0)."""

    temperature: Annotated[float, Gt(0)] = 1.0
    """Sampling temperature; the trainer divides its logits by it too, so both score the same distribution."""

    top_p: Annotated[float, Gt(0)] = 1.0
    """Sample from the smallest set of most likely tokens whose probability reaches top_p (1 = all)."""

    top_k: Annotated[int, Ge(0)] = 0
    """Sample from the k most likely tokens (0 = all)."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion besides the tokenizer's end-of-sequence and the chat template's
    end-of-turn ids (kept as the completion's last token, trained on)."""

    reward_funcs: list[str] = field(default_factory=lambda: ["exact"])
    """Reward functions, summed with `reward_weights`: built-in `exact` (the completion, stripped, equals the
    answer), `numeric` (its last number equals the answer's within 1e-6 relative), `format` (the completion
    matches `format_pattern`), or your own as "package.module:function", called
    function(completion: str, answer: str, prompt: str) -> float (imported from your environment, never from
    a data file)."""

    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward function ([] = all 1)."""

    reward_model: str = ""
    """A reward model scoring every completion beside the reward functions: the checkpoint (a step-N folder, or a
    checkpoint folder: its newest complete step) of a run with dpo.loss_type = "bradley_terry", of the policy's
    family and tokenizer; rebuilt as it recorded itself, sharded like the policy, its score (the logit of token 0
    where the completion ends: posttrain/reward_model.py) added times reward_model_weight. "" = none
    (reward_funcs may then be empty)."""

    reward_model_weight: float = 1.0
    """The weight of the reward model's score in a completion's reward."""

    environment: str = ""
    """Multi-turn rollouts: "package.module:function", a factory (imported from your environment, never from a data
    file) called once per completion, returning an object with reset(prompt, answer) -> str and step(text) ->
    (observation, reward, done); the model and it take turns until done (posttrain/environments.py). The
    observation's tokens are context, never trained on; the completion's reward adds the rewards step returned
    (reward_funcs, which may then be empty, score the model's last turn). "" = one turn, no environment."""

    max_turns: Annotated[int, Ge(1)] = 4
    """The most turns of the model in an episode with an environment (each up to max_completion_length tokens)."""

    max_staleness: Annotated[int, Ge(0)] = 0
    """How many policy versions the rollouts may lag: 0 samples each iteration's rollouts with the current weights
    (synchronous); 1 samples the next iteration's in the background while the trainer trains on this one's
    (posttrain/ahead.py), so they come from the policy one iteration earlier -- corrected by decoupled PPO, which
    needs old_logps = "trainer" (the proximal policy) and importance_sampling_cap (the behaviour weight), and the
    sampling copy (generator = "copy")."""

    format_pattern: str = ""
    """The regular expression the `format` reward checks (the whole completion must match it)."""

    on_reward_error: Literal["zero", "stop"] = "zero"
    """A reward function that raises or returns something that is not a finite number during training:
    `zero` scores that completion 0, counts it (grpo/reward_errors) and warns once per function; `stop` ends
    the run with one line naming the function and the prompt (exit 2). Both are checked on the first
    prompt before training starts, where any failure stops the launch."""

    beta: Annotated[float, Ge(0)] = 0.0
    """Weight of the KL penalty to the reference (the initial weights): a frozen copy sharded like the model,
    or with LoRA the model with its adapters off. 0: no reference at all (no copy, no reference pass)."""

    epsilon: Annotated[float, Gt(0)] = 0.2
    """Clipping range of the importance ratio: [1 - epsilon, 1 + epsilon_high]."""

    epsilon_high: Annotated[float, Ge(0)] = 0.0
    """Upper clipping bound above 1 (DAPO's clip-higher); 0 = epsilon."""

    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    """How the per-token losses make the step's loss (TRL's names; docs/post_training.md). `dapo`: the mean over
    every completion token of the global batch, each token weighing the same (DAPO's token-level loss). `grpo`:
    each completion's token mean, then the mean over the global batch's completions (the original GRPO: a token
    of a long completion weighs less). `dr_grpo`: the sum over every completion token divided by the global
    completions x max_completion_length (Dr. GRPO: a constant normaliser, no length bias; pair it with
    scale_rewards = false)."""

    importance_sampling_level: Literal["token", "sequence"] = "token"
    """The importance ratio and its clipping: `token`, one ratio per token (GRPO, DAPO); `sequence`, one per
    completion -- the geometric mean of its tokens' ratios, exp(mean over its tokens of logp - old) -- clipped as
    a whole and applied to every token of the completion (GSPO; its paper clips at epsilon 3e-4, epsilon_high
    4e-4)."""

    scale_rewards: bool = True
    """Divide each group's centred rewards by their standard deviation (GRPO); false keeps them centred only
    (Dr. GRPO)."""

    generator: str = "trainer"
    """Which model samples. `trainer`: the model being trained, in its layout (FSDP units gathered once for the
    whole sampling, TP groups sampling together; FSDP / HSDP / TP / DDP / EP). `copy`: an unsharded copy of the
    weights on every rank, synced from the model before each iteration -- one more copy of the weights per rank,
    and any layout, pipeline and context parallelism included. Or "package.module:function", a factory of your own
    generator (an external inference engine such as vLLM, fed as the copy is), imported from your environment and
    called with a `posttrain/generators.py::GeneratorContext` (docs/post_training.md)."""

    generator_ranks: Annotated[int, Ge(0)] = 0
    """Ranks apart for sampling: the job's last `generator_ranks` ranks each hold the sampling copy (generator =
    "copy") and sample for the trainer ranks (trainer rank t's prompts on generator rank T + t mod generator_ranks),
    the first T = world - generator_ranks train in the [parallelism] layout; weights go from trainer rank 0 to
    every generator after each update (posttrain/generator_ranks.py). At most T. 0: the copy lives on every
    trainer rank (colocated)."""

    generator_tensor_parallel_degree: Annotated[int, Ge(1)] = 1
    """With generator_ranks: the tensor-parallel degree of each generator (its copy's heads, MLP and vocabulary split
    over that many generator ranks, which sample the same rows together); generator_ranks / this many replicas."""

    generator_transport: Literal["gloo", "nccl"] = "gloo"
    """How the weights reach the generator ranks: `gloo`, through host memory (any device); `nccl`, between the GPUs
    (CUDA jobs)."""

    old_logps: Literal["sampler", "trainer"] = "sampler"
    """The log-probs of the sampling policy in the importance ratio. `sampler`: those the sampler computed while
    sampling (free; equal to the train step's within float rounding: 1e-6 relative in float32). `trainer`: one
    more forward of the train step over each batch of rollouts, micro-batch by micro-batch as the steps cut
    them, so the first step of an iteration has ratio 1 exactly (bitwise in deterministic mode) -- the choice
    for mixed precision, or for an external generator whose kernels differ."""

    importance_sampling_cap: Annotated[float, Ge(0)] = 0.0
    """Correct the sampler's mismatch with the trainer (an external engine's kernels and dtype, say): with
    old_logps = "trainer", each token's policy term is weighted by min(exp(old - sampler), cap), the sampler's
    log-probs kept beside the trainer's (truncated importance sampling; TRL's vllm_importance_sampling_cap). 0:
    off."""

    skip_long_prompts: bool = False
    """A prompt whose tokens plus max_completion_length exceed training.seq_len: false stops the launch with
    its file:line; true drops it (the count is logged at start)."""

    def validate(self) -> None:
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"[grpo.reward_weights] {len(self.reward_weights)} weights for "
                              f"{len(self.reward_funcs)} reward functions: give one per function, or none")
        if not self.reward_funcs and not self.reward_model and not self.environment:
            raise ConfigError("[grpo.reward_funcs] name at least one reward function (or a grpo.reward_model or "
                              "grpo.environment)")
        if self.environment and ":" not in self.environment:
            raise ConfigError(f"[grpo.environment] {self.environment!r} is not a factory's import path "
                              f"\"package.module:function\"")
        for name in self.reward_funcs:
            if name not in BUILTIN_REWARDS and ":" not in name:
                raise ConfigError(f"[grpo.reward_funcs] {name!r} is neither a built-in reward "
                                  f"({', '.join(BUILTIN_REWARDS)}) nor an import path \"package.module:function\"")
        if "format" in self.reward_funcs and not self.format_pattern:
            raise ConfigError("[grpo.format_pattern] the format reward needs the regular expression completions "
                              "must match")
        if self.overlong_buffer_len > self.max_completion_length:
            raise ConfigError(f"[grpo.overlong_buffer_len] {self.overlong_buffer_len} is longer than "
                              f"max_completion_length ({self.max_completion_length}): the shaping starts that many "
                              f"tokens before the limit")
        if self.generator not in ("trainer", "copy") and ":" not in self.generator:
            raise ConfigError(f"[grpo.generator] {self.generator!r} is neither \"trainer\", \"copy\" nor a factory's "
                              f"import path \"package.module:function\"")
        if self.generator_ranks and self.generator != "copy":
            raise ConfigError(f"[grpo.generator_ranks] {self.generator_ranks} ranks apart sample with the sampling copy "
                              f"they hold: set grpo.generator = \"copy\" (not {self.generator!r})")
        tp = self.generator_tensor_parallel_degree
        if tp > 1 and (not self.generator_ranks or self.generator_ranks % tp):
            raise ConfigError(f"[grpo.generator_tensor_parallel_degree] {tp} splits each generator over that many of "
                              f"grpo.generator_ranks ({self.generator_ranks}): make it a multiple of {tp}")
        if self.importance_sampling_cap and (self.old_logps != "trainer" or self.importance_sampling_cap < 1):
            raise ConfigError(f"[grpo.importance_sampling_cap] {self.importance_sampling_cap:g} weights each token by "
                              f"min(exp(trainer - sampler log-prob), cap): it needs grpo.old_logps = \"trainer\" "
                              f"(now {self.old_logps!r}) and a cap of at least 1 (e.g. 2), or 0 for off")
        if self.max_staleness:
            self._check_staleness()
        if self.epsilon >= 1:
            raise ConfigError(f"[grpo.epsilon] {self.epsilon} must be below 1 (the ratio's lower bound 1 - epsilon)")

    def _check_staleness(self) -> None:
        if self.max_staleness > 1:
            raise ConfigError(f"[grpo.max_staleness] {self.max_staleness}: rollouts lag by at most 1 policy version (the "
                              f"sampling copy holds one version; more would need a copy per version)")
        if self.old_logps != "trainer" or not self.importance_sampling_cap:
            raise ConfigError("[grpo.max_staleness] 1 trains on rollouts of the policy one iteration earlier, which needs "
                              "a correction: set grpo.old_logps = \"trainer\" (the proximal policy of decoupled PPO) and "
                              "grpo.importance_sampling_cap (the behaviour weight's cap, e.g. 2)")
        if self.generator != "copy":
            raise ConfigError(f"[grpo.max_staleness] 1 samples in the background with the sampling copy: set "
                              f"grpo.generator = \"copy\" (not {self.generator!r})")
        for key, on in (("dynamic_sampling", self.dynamic_sampling), ("reward_model", self.reward_model),
                        ("environment", self.environment)):
            if on:
                raise ConfigError(f"[grpo.{key}] runs collectives while it samples, which the background sampling of "
                                  f"grpo.max_staleness = 1 cannot: turn one of them off")

    @property
    def clip_high(self) -> float:
        """The ratio's upper clipping bound above 1."""
        return self.epsilon_high or self.epsilon


def check_grpo(job) -> None:
    """[grpo] against the other sections (JobConfig.validate calls it): prompt data and the policy loss go together;
    layouts the rollout loop does not run under yet are refused in one line each."""
    grpo, dims = job.grpo, job.parallelism
    if not check_loss_section(job, "grpo", grpo.enable, "prompts", "GRPO's policy loss",
                              "completions it samples of prompts with reference answers", "the rewards of its samples"):
        return
    if job.dpo.enable:
        raise ConfigError("[grpo.enable] and [dpo.enable] are two different losses: enable one")
    for key, degree in (("pipeline_parallel_degree", dims.pipeline_parallel_degree),
                        ("context_parallel_degree", dims.context_parallel_degree)):
        if degree > 1 and grpo.generator == "trainer":
            raise ConfigError(f"[grpo.generator] the model being trained cannot sample one token at a time under "
                              f"parallelism.{key} = {degree}: set grpo.generator = \"copy\" (an unsharded copy "
                              f"samples, its weights synced before each iteration)")
    for key, degree in (("pipeline_parallel_degree", dims.pipeline_parallel_degree),
                        ("context_parallel_degree", dims.context_parallel_degree)):
        if degree > 1 and grpo.reward_model:
            raise ConfigError(f"[grpo.reward_model] the reward model scores completions in the data-parallel and "
                              f"tensor-parallel layouts, not yet under parallelism.{key} = {degree}")
    if grpo.dynamic_sampling and job.fault.replica_ft:
        raise ConfigError("[grpo.dynamic_sampling] chooses among every data-parallel rank's groups, which the replica "
                          "groups of fault.replica_ft do not share: turn one of them off")
