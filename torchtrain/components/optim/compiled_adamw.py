"""AdamW (and Adam) whose step is one compiled kernel per parameter, doing the clip and refreshing the
compute copy on the way.

Eagerly, a bf16 step over float32 parameters p with gradients g and moments m, v passes over memory
three times after the gradient norm:

    clip          g <- g * c                       read g, write g          8 bytes / parameter
    AdamW         p, m, v <- adamw(p, g, m, v)     read p g m v, write p m v  28
    next step     p16 <- p                         read p, write p16         6

Here the three are one element-wise pass, compiled by Inductor (Triton on CUDA, C++ on the CPU):

    g' = g * c
    p  <- p * (1 - lr wd)                          (Adam instead: g' <- g' + wd p)
    m  <- m + (1 - b1) (g' - m)
    v  <- b2 v + (1 - b2) g'^2
    p  <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    p16 <- p                                       (rounded from the value still in registers)

reading p g m v and writing p m v p16: 30 bytes a parameter instead of 42 -- at memory bandwidth, the
step's optimizer time falls by that ratio. The arithmetic is torch's AdamW's (`torch.optim.AdamW`,
decoupled weight decay, no amsgrad), evaluated in float32 from the step count on the device (as its
fused kernel does; the bias corrections of all parameters in a few launches before the pass), so it
differs from the eager optimizer only by float32 rounding.

One graph serves every parameter: tensors are passed flattened with a dynamic length, and every
hyperparameter, the clip factor and the bias corrections are tensors, so a changing learning rate never
recompiles -- and no value is baked into the graph (with the betas as Python float constants, a run
was served a graph compiled for other betas by Inductor's caches, seen with torch 2.11 and 2.13:
tests/test_compiled_optimizer.py steps two sets of betas in one process). The optimizer's state is
torch's (`step`, `exp_avg`, `exp_avg_sq` per parameter, `step` a float32 tensor on the parameter's
device, as for the fused kernel), so checkpoints are interchangeable with runs using torch's optimizers.

The Layout decides where this applies (`Layout.compiled_optimizer_step`); the train step hands over
the clip factor (`grad_scale`) and the compute copy to refresh (`copies`). With one micro-batch a step the
gradients stay in bf16 on the compute copy (`Layout.grads_in_compute_dtype`): the update reads those
(28 bytes a parameter), and the float32 upcast each gradient otherwise gets in backward (6 bytes) is gone.
"""

from __future__ import annotations

from typing import Callable

import torch

from torchtrain.components.optim.closure import closure_loss

Kernel = Callable[..., None]


def adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, copy: torch.Tensor | None,
                 bias1: torch.Tensor, bias2_sqrt: torch.Tensor, lr: torch.Tensor, weight_decay: torch.Tensor,
                 scale: torch.Tensor, betas: torch.Tensor, decoupled: bool) -> None:
    """One parameter's update (the module doc's formulas), in place; `copy`, when given, receives p's new
    value in its dtype. `bias1` = 1 - b1^t and `bias2_sqrt` = sqrt(1 - b2^t) at this step's count t
    (`bias_corrections`); `betas` holds b1, 1 - b1, b2, 1 - b2 and eps (`constants`); every
    hyperparameter is a tensor."""
    _, one_minus_beta1, beta2, one_minus_beta2, eps = betas.unbind()
    g = g.float() * scale
    if decoupled:
        p.mul_(1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m.lerp_(g, one_minus_beta1)
    v.mul_(beta2).add_(one_minus_beta2 * g * g)
    p.sub_((lr / bias1) * (m / (v.sqrt() / bias2_sqrt + eps)))
    if copy is not None:
        copy.copy_(p)


def bias_corrections(steps: list[torch.Tensor], beta1: float, beta2: float) -> tuple[list, list]:
    """1 - b1^t and sqrt(1 - b2^t) for each step count t (0-d tensors): a few launches for all parameters,
    outside the element-wise pass."""
    bias1, bias2 = torch._foreach_pow(beta1, steps), torch._foreach_pow(beta2, steps)
    for values in (bias1, bias2):
        torch._foreach_neg_(values)
        torch._foreach_add_(values, 1.0)
    torch._foreach_sqrt_(bias2)
    return bias1, bias2


def constants(beta1: float, beta2: float, eps: float, device: torch.device) -> torch.Tensor:
    """`adamw_update`'s `betas`: the complements computed in float64, then rounded (as torch's optimizers
    take them: 1 - 0.999 in float32 arithmetic would be 1.3e-5 off)."""
    return torch.tensor([beta1, 1 - beta1, beta2, 1 - beta2, eps], dtype=torch.float32, device=device)


_compiled: Kernel | None = None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as one dimension (every parameter then shares the graph); others as they are."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t


def compiled_update() -> Kernel:
    """`adamw_update` compiled once for the process (dynamic lengths, the whole function one graph)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(adamw_update, dynamic=True, fullgraph=True)
    return _compiled


def _raise_if_compile_error(e: Exception) -> None:
    """A failure of torch.compile itself (Dynamo or Inductor: no compiler, a Triton error) ends the run with
    one line naming the key that turns the compiled step off."""
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(e, TorchDynamoException):
        from torchtrain.config.fields import ConfigError

        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"[compile.components] compiling the optimizer step failed ({type(e).__name__}: "
                          f"{reason}); set compile.components = [\"model\", \"loss\"] to step with torch's "
                          f"optimizer kernel") from e


class CompiledStep:
    """The step shared by `CompiledAdamW` and `CompiledAdam` (mixed in before the torch class)."""

    _step_supports_amp_scaling = False  # no loss scaling in this mode (the Layout's rule)
    _decoupled = True

    def _setup(self) -> None:
        self.grad_scale: torch.Tensor | None = None
        """Factor applied to every gradient in the next step (the clip factor); None: 1."""
        self.copies: dict[int, torch.Tensor] = {}
        """id(parameter) -> the compute copy its new value is written to (when its storage is allocated)."""
        self.kernel: Kernel | None = None
        """The per-parameter update; None: `compiled_update()`. The planner's trace sets a stand-in."""
        self.written: list[torch.Tensor] = []
        """The parameters whose copy the last step wrote (the compute copy marks them fresh)."""
        self._constants: dict[tuple, torch.Tensor] = {}

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """p's gradient: its `.grad`, or, where the compute copy keeps the gradients in its dtype
        (`ComputeCopy.keep_grads`), its copy's, upcast by the update as it reads it."""
        if p.grad is not None:
            return p.grad
        copy = self.copies.get(id(p))
        return copy.grad if copy is not None else None

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device or state["step"].dtype != torch.float32:
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        kernel = self.kernel or compiled_update()
        self.written = []
        for group in self.param_groups:
            grads = {id(p): g for p in group["params"] if (g := self.grad_of(p)) is not None}
            params = [p for p in group["params"] if id(p) in grads]
            if not params:
                continue
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("the compiled AdamW step has no amsgrad or maximize")
            device = params[0].device
            lr, wd = (torch.full((), float(x), dtype=torch.float32, device=device)
                      for x in (group["lr"], group["weight_decay"]))
            key = (*(float(b) for b in group["betas"]), float(group["eps"]), device)
            if key not in self._constants:  # (made once: a host-to-device copy)
                self._constants[key] = constants(*key)
            scale = self.grad_scale if self.grad_scale is not None else torch.ones((), device=device)
            states = [self._state(p) for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)
            bias1, bias2_sqrt = bias_corrections(steps, key[0], key[1])
            for p, state, b1, b2 in zip(params, states, bias1, bias2_sqrt):
                copy, update = self.copies.get(id(p)), kernel
                if copy is not None and copy.untyped_storage().nbytes() == 0:
                    # not allocated before the first forward (the state's set-up step when a checkpoint
                    # loads): eagerly, without the copy, which is cast afresh when first used
                    copy, update = None, adamw_update
                try:
                    update(_flat(p), _flat(grads[id(p)]), _flat(state["exp_avg"]), _flat(state["exp_avg_sq"]),
                           _flat(copy) if copy is not None else None, b1, b2, lr, wd, scale, self._constants[key],
                           self._decoupled)
                except Exception as e:
                    _raise_if_compile_error(e)
                    raise
                if copy is not None:
                    self.written.append(p)
        self.grad_scale = None
        return loss


class CompiledAdamW(CompiledStep, torch.optim.AdamW):
    """torch's AdamW with the compiled step of this module."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._setup()


class CompiledAdam(CompiledStep, torch.optim.Adam):
    """torch's Adam (L2 weight decay added to the gradient) with the compiled step of this module."""

    _decoupled = False

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._setup()
