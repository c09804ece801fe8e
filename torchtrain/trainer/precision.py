"""Loss scaling for float16: dynamic scaling that skips steps whose gradients overflow.

float16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The loss is multiplied by a scale
S (initially 2^16) before backward so gradients live in float16's range; they are divided by S
before clipping and the optimizer step. If any gradient is inf/nan, the step is skipped on every
rank (the scaler's found-inf flag is all-reduced across the sharded gradients) and S is halved;
after `growth_interval` clean steps S doubles. bfloat16 and float32 need none of this.

Sharded gradients (FSDP) use torch's ShardedGradScaler, which all-reduces the found-inf flag. The fused
Adam/AdamW kernels (the default, on CUDA and on the CPU) take that flag as it is, and two of its forms
break them: its shape (1,) -- they subtract it from their scalar step counters when a step overflows --
and its value, the SUM over the ranks: they skip the update only when it is exactly 1, so an overflow
seen by two ranks' shards (2.0) would apply the non-finite update and ruin every parameter.
`_sharded_scaler` hands them the flag as a scalar view of the same storage, clamped to 1 after the
all-reduce.

`reads_back = False` (set by the planner's trace, whose fake tensors hold no values) runs the same
kernels without reading a value back to the host: the fused optimizers still get the scale and the
found-inf flag as tensors, the others step on the gradients `unscale_` divided, whatever the flag says;
the scale is updated by `torch._amp_update_scale_` (the kernel CUDA runs; the sharded scaler's CPU path
reads the flag), every step counts as taken, and `factor` is the initial scale.
"""

from __future__ import annotations

import torch

from torchtrain.components.optim.optimizer import OptimizersContainer


class LossScaler:
    def __init__(self, enabled: bool, sharded: bool, device: torch.device):
        self.enabled = enabled
        self.skipped_steps = 0
        self._scaler = None
        self.reads_back = True
        """Whether values may be read back to the host; False in a traced step (see the module doc)."""
        if enabled:
            if sharded:
                self._scaler = _sharded_scaler(device)
            else:
                self._scaler = torch.amp.GradScaler(device.type)
            self._initial = self._scaler.get_scale()  # its init scale: no tensor before the first `scale`

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self._scaler.scale(loss) if self.enabled else loss

    def unscale_(self, optimizers: OptimizersContainer) -> None:
        if self.enabled:
            for opt in optimizers:
                self._scaler.unscale_(opt)

    def step(self, optimizers: OptimizersContainer) -> bool:
        """Optimizer step unless gradients overflowed; returns whether the step was taken."""
        if not self.enabled:
            optimizers.step()
            return True
        if not self.reads_back:
            for opt in optimizers:
                if getattr(opt, "_step_supports_amp_scaling", False):  # fused: flags passed as tensors
                    self._scaler.step(opt)
                else:
                    opt.step()
            self._update()
            return True
        before = self._scaler.get_scale()
        for opt in optimizers:
            self._scaler.step(opt)
        self._scaler.update()
        skipped = self._scaler.get_scale() < before
        self.skipped_steps += int(skipped)
        return not skipped

    def skip(self, optimizers: OptimizersContainer) -> bool:
        """Skip this step's update (a guard decision) but keep the scale's bookkeeping: the scale still
        reacts to this step's gradients (halved on an overflow, grown after enough clean steps).
        Returns False (no step taken)."""
        if not self.enabled:
            return False
        if not self.reads_back:
            self._update()
            return False
        before = self._scaler.get_scale()
        self._scaler.update()
        self.skipped_steps += int(self._scaler.get_scale() < before)  # it overflowed as well
        return False

    @property
    def factor(self) -> float:
        """What `scale` multiplies the loss by now (1 without loss scaling)."""
        if not self.enabled:
            return 1.0
        return self._scaler.get_scale() if self.reads_back else self._initial

    def _update(self) -> None:
        """The scale's update without a read-back: GradScaler's own (`torch._amp_update_scale_` on every
        device), which the sharded scaler runs on CUDA as well."""
        torch.amp.GradScaler.update(self._scaler)

    @property
    def value(self) -> float | None:
        return self._scaler.get_scale() if self.enabled else None


def _sharded_scaler(device: torch.device):
    """torch's ShardedGradScaler whose per-device found-inf flags are scalars of 0 or 1 (the fused
    optimizers need both; see the module doc). The views share the flags' storage, so its in-place
    all-reduce still lands."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class ScalarFlagScaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            return {dev: flag.reshape(()) for dev, flag in per_device.items()}

        def unscale_(self, optimizer) -> None:
            super().unscale_(optimizer)  # the flags are summed over the ranks here
            for flag in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                flag.clamp_(max=1.0)

    return ScalarFlagScaler(device=device.type)
