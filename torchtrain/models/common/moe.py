"""A reusable mixture-of-experts feed-forward layer: router, load balancing, dispatch to the experts.

For the T tokens of one forward (x reshaped to (T, D)), with E routed experts and top-k:

1. **route**: scores s = softmax(x W_r^T) (or sigmoid), each token's k experts are the top-k of
   s + b (b: the load-balancing bias, zero unless enabled), and its gate weights are those experts'
   scores s (renormalised to sum 1 with `norm_topk_prob`, times `route_scale`). With group-limited
   routing (DeepSeek-V3's node-limited routing: `n_group` G > 1) the E experts form G equal groups
   (one per node when EP places a group per node); a group's score is the sum of its two best s + b,
   and a token's top-k is taken only among the experts of its `topk_group` best groups, so its
   tokens travel to at most topk_group nodes;
2. **dispatch** (the experts' token dispatcher, `dispatch.py`): the T x k (token, expert) pairs are
   sorted by expert (a stable sort, so the order is the same under any layout) and the experts
   (`experts.py`) run over their groups of rows -- every pair is computed: no capacity limit, no
   token dropped;
3. **combine**: each token's output is the gate-weighted sum of its k experts' outputs (summed in
   the order of its top-k), plus the shared experts' output when the layer has any (scaled by a
   sigmoid gate of the token, sigmoid(x w_g), with `shared_expert_gate`).

Expert parallelism replaces the dispatcher of step 2 (`distributed/token_dispatch.py`); the layer
itself has no parallel code.

**Load balancing** (docs/moe.md), each switchable:

* the auxiliary loss (Switch Transformer / GShard), `aux_loss_coeff` = alpha. For the tokens t of one
  sequence, f_i = E x (pairs routed to expert i) / (pairs of the sequence) and p_t the token's score
  distribution (the scores themselves for softmax; normalised to sum 1 for sigmoid). Each token adds
  alpha x sum_i f_i p_t,i to its loss, so the term joins the token-mean loss with the same
  normalisation (1/N over the step's target tokens) and equals alpha x E x sum_i f_i P_i per sequence,
  minimal (alpha) when the load is uniform. f is computed per sequence -- not per micro-batch or per
  rank -- so the loss is the same under any data-parallel layout or accumulation, and f is constant
  (its gradient flows through p only). The term's gradient is injected in backward (`extra_loss.py`): the
  layer's output is unchanged, so the loss reaches pipeline stages that do not compute the
  cross-entropy. The trainer sets `aux_loss_scale` to the scale of the step's loss (dp / N, x the
  float16 loss scale);
* the auxiliary-loss-free bias of DeepSeek-V3, `load_balance_coeff` = gamma: the buffer b is added to
  the scores for the top-k choice only; after each step the trainer moves it by gamma towards balance
  from the step's global per-expert token counts (`trainer/moe_balance.py`).

During training forwards the layer adds each expert's token count (`tokens_per_expert`) and its
summed auxiliary loss (`aux_loss_sum`) to buffers that the trainer reads and resets every step. A
forward recomputed by activation checkpointing (it runs inside backward) or marked uncounted
(`models.base.forward_counting`) adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import InitSpec
from torchtrain.models.common.decoder import output_std
from torchtrain.models.common.dispatch import histogram
from torchtrain.models.common.experts import GroupedExperts
from torchtrain.models.common.extra_loss import add_loss_gradient, counts_statistics
from torchtrain.models.common.layers import FeedForward


@dataclass
class MoEModelArgs:
    """The mixture-of-experts arguments of a model (a mixin of its arguments dataclass: `[model]` keys)."""

    num_experts: int = 8
    """Routed experts per MoE layer."""

    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""

    moe_intermediate_size: int = 256
    """Hidden size of each expert's SwiGLU."""

    norm_topk_prob: bool = True
    """Renormalise a token's top-k gate weights to sum 1."""

    num_shared_experts: int = 0
    """Experts every token goes through besides its routed ones (one SwiGLU of this many times
    moe_intermediate_size)."""

    shared_expert_gate: bool = False
    """Scale the shared experts' output by a learned sigmoid gate per token, sigmoid(x w_g) (Qwen3.5)."""

    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts, or an independent sigmoid per expert (DeepSeek-V3)."""

    route_scale: float = 1.0
    """Factor applied to the gate weights."""

    moe_aux_loss_coeff: float = 0.001
    """Weight of the auxiliary load-balancing loss (Switch/GShard, computed per sequence); 0 disables it."""

    moe_load_balance_coeff: float = 0.0
    """Step size of DeepSeek-V3's auxiliary-loss-free balancing: after every step each expert's
    routing bias moves by this much towards balance (from the step's global token counts); 0 disables it."""

    n_group: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3: 8, one per node); 1: no limit."""

    topk_group: int = 1
    """Groups a token's experts may come from (DeepSeek-V3: 4); only read when n_group > 1."""

    use_grouped_mm: bool = True
    """Compute the experts with one grouped GEMM per matmul where the device supports it (CUDA sm90+
    in bfloat16); otherwise (or false) a loop over the experts."""

    def validate_moe(self) -> None:
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"[model.{key}] must be >= 1, got {getattr(self, key)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"[model.num_experts_per_tok] {self.num_experts_per_tok} exceeds model.num_experts "
                              f"({self.num_experts}): a token cannot be routed to more experts than exist")
        for key in ("num_shared_experts",):
            if getattr(self, key) < 0:
                raise ConfigError(f"[model.{key}] must be >= 0, got {getattr(self, key)}")
        for key in ("moe_aux_loss_coeff", "moe_load_balance_coeff"):
            if getattr(self, key) < 0:
                raise ConfigError(f"[model.{key}] must be >= 0 (0 disables it), got {getattr(self, key)}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ConfigError(f"[model.n_group] {self.n_group} must be >= 1 and divide model.num_experts "
                              f"({self.num_experts}): the experts form equal groups")
        if self.n_group > 1:
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"[model.topk_group] {self.topk_group} must be between 1 and model.n_group "
                                  f"({self.n_group})")
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                raise ConfigError(f"[model.n_group] {self.n_group} groups of {per_group} expert: a group's score "
                                  f"is the sum of its two best experts, so groups need >= 2 experts")
            if self.topk_group * per_group < self.num_experts_per_tok:
                raise ConfigError(f"[model.topk_group] {self.topk_group} groups of {per_group} experts cannot hold "
                                  f"num_experts_per_tok = {self.num_experts_per_tok} experts; raise topk_group")
        if self.route_scale <= 0:
            raise ConfigError(f"[model.route_scale] must be > 0, got {self.route_scale}")

    def validate(self) -> None:
        """The dense model's checks (the next of the model's argument bases), then the experts'."""
        super().validate()
        self.validate_moe()

    def ffn_params(self, active: bool = False) -> int:
        """Parameters of one block's feed-forward, an MoE layer at the model's width (all, or one token's)."""
        total, used = self.moe_params(self.dim)
        return used if active else total

    def moe_params(self, dim: int) -> tuple[int, int]:
        """(total, active per token) parameters of one MoE layer of width `dim`: routed experts (all,
        or top-k), shared experts and the router."""
        expert = 3 * dim * self.moe_intermediate_size
        fixed = self.num_shared_experts * expert + dim * self.num_experts
        if self.num_shared_experts and self.shared_expert_gate:
            fixed += dim
        return self.num_experts * expert + fixed, self.num_experts_per_tok * expert + fixed


class SequenceSum(nn.Identity):
    """Sums per-sequence statistics over the ranks that hold parts of one sequence: the identity on one
    rank; tensor parallelism's plan makes it an all-reduce over the sequence-parallel shards
    (`models/common/tp.py::moe_tp_plan`), context parallelism one over the CP ranks
    (`distributed/context_parallel.py`)."""


_histogram = histogram


class MoE(nn.Module):
    """x (B, S, D) -> (B, S, D). See the module doc."""

    def __init__(self, dim: int, args: MoEModelArgs, experts: GroupedExperts | None = None, router_bias: bool = False):
        """`experts`: the routed experts (a model's own `GroupedExperts` subclass; default SwiGLU experts);
        `router_bias`: the router's logits have a learned bias (gpt-oss)."""
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.score_func, self.norm_topk_prob, self.route_scale = args.score_func, args.norm_topk_prob, args.route_scale
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.aux_loss_coeff, self.load_balance_coeff = args.moe_aux_loss_coeff, args.moe_load_balance_coeff
        self.router = nn.Linear(dim, args.num_experts, bias=router_bias)
        self.experts = experts if experts is not None else GroupedExperts(dim, args.moe_intermediate_size,
                                                                          args.num_experts, args.use_grouped_mm)
        self.shared_experts = (FeedForward(dim, args.moe_intermediate_size * args.num_shared_experts)
                               if args.num_shared_experts else None)
        self.shared_gate = (nn.Linear(dim, 1, bias=False)
                            if args.num_shared_experts and args.shared_expert_gate else None)
        self.sequence_sum = SequenceSum()
        if self.load_balance_coeff > 0:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts))
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss_scale", torch.ones(()), persistent=False)

    # ------------------------------------------------------------------ routing
    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (T, E) float32, top-k expert ids (T, k), gate weights (T, k) float32)."""
        logits = self.router(tokens).float()
        scores = torch.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.n_group > 1:
            choice = self._limit_to_groups(choice)
        idx = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        return scores, idx, weights * self.route_scale

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` (T, E) with the experts outside each token's topk_group best groups set to -inf
        (a group's score: the sum of its two highest choice scores)."""
        grouped = choice.view(choice.shape[0], self.n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        best = group_score.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def _aux_loss(self, scores: torch.Tensor, idx: torch.Tensor, batch: int) -> torch.Tensor:
        """Sum over this forward's tokens of sum_i f_i p_t,i (f per sequence; see the module doc)."""
        E = self.num_experts
        seq_of = torch.arange(batch, device=idx.device).repeat_interleave(idx.numel() // batch) * E
        pairs = _histogram(seq_of + idx.reshape(-1), batch * E).view(batch, E).float()
        pairs = self.sequence_sum(pairs)  # whole-sequence counts under sequence sharding
        f = E * pairs / pairs.sum(-1, keepdim=True).clamp(min=1.0)
        p = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return (p.view(batch, -1, E) * f.unsqueeze(1)).sum()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, dim = x.shape[0], x.shape[-1]
        tokens = x.reshape(-1, dim)
        scores, idx, weights = self.route(tokens)
        counts = _histogram(idx, self.num_experts)
        use_aux = self.training and self.aux_loss_coeff > 0
        aux = self._aux_loss(scores, idx, batch) if use_aux else None
        if counts_statistics(self, counts):
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.float())
                if aux is not None:
                    self.aux_loss_sum.add_(aux.detach())

        out = self.experts(tokens, idx, weights)  # the token dispatcher: dispatch, experts, combine
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(tokens))
            out = out + shared
        out = out.view_as(x)
        if aux is not None:
            out = add_loss_gradient(out, aux, self.aux_loss_scale * self.aux_loss_coeff)
        return out

    # ------------------------------------------------------------------ init
    @staticmethod
    def init_spec(name: str, std: float, out_std: float) -> InitSpec:
        """Init of the layer's parameter `name` (relative to the layer): truncated normal with `std`,
        `out_std` for the matrices that write back to the residual stream (experts' w2)."""
        if name.endswith("w2") or name.endswith("w2.weight"):
            return InitSpec("trunc_normal", std=out_std)
        return InitSpec("trunc_normal", std=std)

    def reset_statistics(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()

    def init_buffers(self) -> None:
        """Initial buffer values (after materialisation from the meta device): no bias, no counts."""
        self.reset_statistics()
        self.aux_loss_scale.fill_(1.0)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def moe_layers(module: nn.Module) -> list[tuple[str, MoE]]:
    """(canonical name, layer) of every MoE layer in `module` (wrapper prefixes removed)."""
    out = []
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            for prefix in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
                name = name.replace(prefix, "")
            out.append((name, m))
    return out


class MoEDecoder:
    """Mixin of a decoder (`models/common/transformer.py::Decoder`) whose blocks' feed-forward is an `MoE` at
    `feed_forward`: the layer's initialisation (`MoE.init_spec`, depth-scaled output projections) and its
    buffers. Listed before the decoder class it mixes into."""

    def init_spec(self, fqn: str) -> InitSpec:
        head, sep, rest = fqn.partition(".feed_forward.")
        if sep:  # router, experts, shared experts and their gate
            return MoE.init_spec(rest, std=0.02, out_std=output_std(fqn, self.args.n_layers, self.args.depth_init))
        return super().init_spec(fqn)

    def init_buffers(self) -> None:
        super().init_buffers()
        for _, layer in moe_layers(self):
            layer.init_buffers()
