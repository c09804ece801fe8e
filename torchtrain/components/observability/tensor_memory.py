"""Live tensor memory: how many bytes of tensor storage a process holds, and its peak, by category.

One definition serves two users, so that their numbers can be compared directly:

* the trainer, when `metrics.track_tensor_memory` is on, measures every training step of a real run
  (`memory_tensor_peak_gib` in metrics.jsonl) -- the only meaningful memory figure on a CPU, whose
  process RSS includes the Python runtime and libraries;
* the planner (`torchtrain.plan`) measures one step of the same model under the same parallel plan
  on fake tensors (no real allocation) and predicts that figure for any world size.

Definition. The tracked memory at any moment is the sum of `nbytes` over the tensor storages that are
alive and known to the tracker: storages created by any operator while the tracker is active (a
`TorchDispatchMode` sees every op output, including autograd's), plus those registered explicitly
(the model's parameters and buffers, the optimizer's state). A storage stops counting when its last
tensor dies (a weak-reference callback) and changes size when it is resized in place
(`UntypedStorage.resize_`, which FSDP2 uses to free and re-allocate gathered parameters; patched while
tracking). Views share their base's storage and count once. Not counted: tensors created before
tracking started and never registered (e.g. the data loader's input batch), and allocator overheads
(CUDA's 512-byte rounding and caching, fragmentation).

Categories at the peak (labels are attached to storages whenever they become known, so a storage
created as an anonymous op output is still labelled if it later turns out to be a gradient):

* `params`          registered parameters (FSDP: this rank's shards) and buffers
* `gathered_params` parameters an op received that are not registered ones: FSDP2's unsharded
                    copies, alive between all-gather and reshard
* `grads`           `.grad` of registered parameters when the optimizer steps (or of their compute
                    copies, where those keep the step's gradients)
* `optimizer`       optimizer state tensors (Adam's exp_avg, exp_avg_sq, step)
* `activations`     everything else: saved activations, gradients of activations, all-gather and
                    reduce-scatter buffers, loss buffers, temporaries of the optimizer step
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from torchtrain.components.optim.compiled_adamw import CompiledStep

CATEGORIES = ("params", "gathered_params", "grads", "optimizer", "activations")
_PATCH_STACK: list["TensorMemoryTracker"] = []
_ORIG_RESIZE = torch.UntypedStorage.resize_


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """Storages backing a tensor; a wrapper subclass (DTensor) is unwrapped to its inner tensors."""
    out, todo = [], [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            names, _ = x.__tensor_flatten__()
            todo += [getattr(x, n) for n in names if isinstance(getattr(x, n), torch.Tensor)]
        else:
            out.append(x.untyped_storage())
    return out


def _patched_resize(storage: torch.UntypedStorage, size: int):
    result = _ORIG_RESIZE(storage, size)
    for tracker in _PATCH_STACK:
        tracker._on_resize(storage)
    return result


class TensorMemoryTracker(TorchDispatchMode):
    """Context manager measuring live tensor bytes; see the module docstring for the definition."""

    def __init__(self) -> None:
        super().__init__()
        self._serial = itertools.count()
        self._live: dict[int, list] = {}        # id(storage) -> [serial, nbytes, weakref]
        self._labels: dict[int, str] = {}       # serial -> category (kept after the storage dies)
        self.current = 0
        self.peak = 0
        self._peak_keys: dict[int, int] = {}    # serial -> nbytes at the peak
        self._pending = False                   # current == peak but not yet snapshotted
        self._hooks: list = []

    # ------------------------------------------------------------------ registration
    def register_model(self, model: nn.Module) -> None:
        """Count the model's parameters and buffers (created before tracking) as `params`."""
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            self._track(tensor, "params", force_label=True)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count existing optimizer state; label gradients and new state each time the optimizer steps."""
        self._label_optimizer(optimizer)

        def pre(opt, args, kwargs):
            self._label_optimizer(opt, grads=True)

        def post(opt, args, kwargs):
            self._label_optimizer(opt)

        self._hooks += [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):  # it keeps its shard's state in a local optimizer
            self.watch_optimizer(optimizer.optim)

    def _label_optimizer(self, opt: torch.optim.Optimizer, grads: bool = False) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                grad = opt.grad_of(p) if isinstance(opt, CompiledStep) else p.grad  # (maybe the compute copy's)
                if grads and grad is not None:
                    self._track(grad, "grads", force_label=True)
                for value in opt.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        self._track(value, "optimizer", force_label=True)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ accounting
    def _track(self, tensor: torch.Tensor, label: str | None = None, force_label: bool = False) -> None:
        for st in _storages(tensor):
            entry = self._live.get(id(st))
            if entry is None:
                serial = next(self._serial)
                entry = [serial, 0, weakref.ref(st, self._make_release(id(st), serial))]
                self._live[id(st)] = entry
                self._resize(entry, st.nbytes())
            elif entry[1] != st.nbytes():
                self._resize(entry, st.nbytes())
            if label is not None and (force_label or entry[0] not in self._labels):
                self._labels[entry[0]] = label

    def _make_release(self, key: int, serial: int):
        def release(_ref) -> None:
            entry = self._live.get(key)
            if entry is not None and entry[0] == serial:
                self._resize(entry, 0)
                del self._live[key]
        return release

    def _resize(self, entry: list, nbytes: int) -> None:
        delta = nbytes - entry[1]
        if delta < 0 and self._pending:
            self._snapshot()
        entry[1] = nbytes
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
            self._pending = True

    def _snapshot(self) -> None:
        self._peak_keys = {serial: nbytes for serial, nbytes, _ in self._live.values() if nbytes}
        self._pending = False

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        entry = self._live.get(id(storage))
        if entry is None:
            self._track_storage_only(storage)
        elif entry[1] != storage.nbytes():
            self._resize(entry, storage.nbytes())

    def _track_storage_only(self, st: torch.UntypedStorage) -> None:
        serial = next(self._serial)
        entry = [serial, 0, weakref.ref(st, self._make_release(id(st), serial))]
        self._live[id(st)] = entry
        self._resize(entry, st.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for arg in itertools.chain(args, (kwargs or {}).values()):
            if isinstance(arg, nn.Parameter):
                self._track(arg, "gathered_params")
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    # ------------------------------------------------------------------ context / results
    def __enter__(self):
        _PATCH_STACK.append(self)
        torch.UntypedStorage.resize_ = _patched_resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _PATCH_STACK.remove(self)
            if not _PATCH_STACK:
                torch.UntypedStorage.resize_ = _ORIG_RESIZE  # type: ignore[method-assign]

    def reset_peak(self) -> None:
        """Start a new peak window at the current level (e.g. after a warm-up step)."""
        self.peak = self.current
        self._pending = True

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes by category at the moment of the peak (sums to `peak`)."""
        if self._pending:
            self._snapshot()
        out = dict.fromkeys(CATEGORIES, 0)
        for serial, nbytes in self._peak_keys.items():
            out[self._labels.get(serial, "activations")] += nbytes
        return out

    def current_breakdown(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for serial, nbytes, _ in self._live.values():
            out[self._labels.get(serial, "activations")] += nbytes
        return out


def track_modules(tracker: TensorMemoryTracker, modules: Iterable[nn.Module],
                  optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Register a training job's persistent state: model parts and their optimizers."""
    for m in modules:
        tracker.register_model(m)
    for opt in optimizers:
        tracker.watch_optimizer(opt)


class StepMemoryMeter:
    """The trainer's side (`metrics.track_tensor_memory`): track each step, report the peak per log.

    Disabled, `track()` is a null context and `record()` returns nothing, so the trainer's hook costs
    nothing. Enabled, the peak covers every step since the previous `record()`.
    """

    def __init__(self, enabled: bool, model_parts: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]):
        self.tracker = TensorMemoryTracker() if enabled else None
        if self.tracker is not None:
            track_modules(self.tracker, model_parts, optimizers)

    def track(self):
        return self.tracker if self.tracker is not None else contextlib.nullcontext()

    def record(self) -> dict[str, float | dict[str, float]]:
        if self.tracker is None:
            return {}
        breakdown = {k: v / 2**30 for k, v in self.tracker.peak_breakdown().items()}
        out = {"memory_tensor_peak_gib": self.tracker.peak / 2**30, "memory_tensor_breakdown_gib": breakdown}
        self.tracker.reset_peak()
        return out
