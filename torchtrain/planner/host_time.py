"""Host time: what the CPU spends issuing one step, and when it, not the GPU, sets the step time.

A GPU only runs what the host has enqueued. In eager mode the host dispatches every operator of the
step one by one -- Python, the dispatcher, autograd's bookkeeping, the kernel launch -- and a step
whose operators are small (a 1B model at a few thousand tokens a step) waits on the host, not on the
GPU. Neither sets the step alone, and they do not simply add: the host runs ahead of the GPU where
the step lets it (a stretch of large GEMMs queues up while the host is still issuing them), and the GPU
waits where it cannot (the step's first operators, a stretch of small element-wise operators that run
faster than they are issued, a synchronization such as the loss or the gradient norm). A step is a
sum over such stretches of the slower side's time: the larger of the two totals when one side dominates
every stretch, up to their sum when they take turns. The planner interpolates between those bounds as

    step = sqrt(GPU time (step_time.py)^2 + host time^2)        (`step_seconds`)

which is the larger of the two when one is well ahead (G = 3H: 1.05 G) and 1.41 x either when they are
equal. Its check is the program the per-operator host costs come from: torchtitan's profiled eager
step, whose operators' own profiled durations (no scaling) add up to 0.135 s of host time against 0.116
s of GPU work, and whose unprofiled step took 0.1774 s: sqrt(0.116^2 + 0.135^2) = 0.178 s (`host_share`
inverts it; the larger-of model would need every profiled duration scaled by 1.32 to explain that step,
and then over-predicts every host-bound step by ~30%).

**What is counted.** The planner's traced step (`trace.py`: the trainer's own step on fake tensors) runs
under `OpCounter`, a `TorchDispatchMode` that sees every operator as a dispatch-level observer does:
the forward, the backward, activation checkpointing's recomputation and the optimizer, each operator
once, composite ones (`linear`, `matmul`) as the operators they decompose into. Each is one of

    kernel    an operator that computes or copies (mm, mul, _to_copy, copy_, _fused_adamw_, ...)
    alias     one that only makes a view or an allocation (view, t, detach, slice, empty, ...): no kernel

and, besides, *handled* if issued from a Python `__torch_dispatch__`: selective activation
checkpointing's policy sees every forward and recomputed operator of a block (and keeps or frees its
output); a tensor subclass dispatches in Python (float8 training tensors, DTensor). Such an operator
costs its dispatch plus the handler's Python.

**Eager.** host = kernel x host_op_us + alias x host_alias_us + handled x host_handler_us (the device
table's per-operator host costs, `components/hardware.py`: a property of the machine, measured from a
profile of another program, see there).

**Compiled** (`compile.enable`: each block, the final norm and the loss are Inductor graphs): the
operators outside the compiled modules (FSDP's and DDP's machinery, the embedding and the output
projection, gradient accumulation, clipping, the optimizer) cost as in eager; each call of a compiled
graph (forward, and backward) costs one operator plus the launch of its kernels, host_launch_us each.
A graph's kernels are not traced (the trace runs eager); they are estimated from the operators traced
inside the compiled modules: each GEMM or attention call stays a kernel of its own, and the
element-wise and reduction work between two of them fuses into one kernel, so

    kernels = 2 x (GEMMs + attention calls inside) + graph calls

**Micro-batches.** The trace runs at most two micro-batches; the forward/backward operators are
counted per traced micro-batch and multiplied by the job's (accumulation steps, or the pipeline's
micro-batches); the optimizer phase counts once.

The counts are the current code's: a change that issues fewer operators (a fused norm, fewer dtype
round trips) lowers the planned host time with no change here. A target without host costs in the
device table (`cpu`: the host is the device) has no host term.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchtrain.components.hardware import GPUSpec

NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
                       "detach", "alias"})
"""Operators that allocate or alias without a kernel (beyond those whose schema returns an alias)."""
EXTERN = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm"})
"""Operators Inductor calls as library kernels rather than fusing (with the attention operators)."""
IGNORED_NAMESPACES = ("prim", "profiler")
"""Not operators a step dispatches: fake tensors' device queries, the profiler's record functions."""
FUSED_ON_CUDA = frozenset({"rms_norm"})
"""`torch.nn.functional` calls that are one kernel forward and one backward on CUDA, and a composition of
several operators on the CPU the trace runs on: counted as the CUDA step dispatches them."""
MACHINERY = ("FSDP::",)
"""Profiler ranges of eager machinery that runs inside a compiled module's call (its hooks)."""
CLASSES = ("kernel", "alias", "handled")

_CLASS: dict[str, str] = {}


def op_class(name: str) -> str:
    """"kernel" or "alias" for an operator named "aten::view" / "aten.view" (see the module doc)."""
    if name not in _CLASS:
        ns, _, op = name.replace("::", ".").partition(".")
        alias = op in NO_KERNEL
        packet = getattr(getattr(torch.ops, ns, None), op, None) if op else None
        if not alias and packet is not None:
            for overload in packet.overloads():
                try:
                    returns = getattr(packet, overload)._schema.returns
                except (RuntimeError, AttributeError):
                    continue  # a TorchScript-only overload
                info = returns[0].alias_info if returns else None
                alias = info is not None and not info.is_write
                break
        _CLASS[name] = "alias" if alias else "kernel"
    return _CLASS[name]


def is_extern(name: str) -> bool:
    op = name.replace("::", ".").partition(".")[2]
    return op in EXTERN or "attention" in op


@dataclass
class OpCounts:
    """Operators of one traced step, by phase ("forward/backward", "optimizer"), class and whether they
    run inside a module the job compiles ("inside") or outside ("outside"; every operator of an eager
    job). `graph_calls`: compiled-module calls (forward + backward); `extern_inside`: GEMM and attention
    calls inside them; `microbatches`: micro-batches the trace ran."""

    ops: Counter = field(default_factory=Counter)
    """(phase, class, inside|outside) -> operators."""
    graph_calls: float = 0.0
    extern_inside: float = 0.0
    microbatches: int = 1

    def total(self, phase: str | None = None, where: str | None = None, cls: str | None = None) -> float:
        return sum(v for (ph, c, w), v in self.ops.items()
                   if (phase is None or ph == phase) and (where is None or w == where) and (cls is None or c == cls))

    def scaled(self, microbatches: int) -> "OpCounts":
        """The counts of a step of `microbatches` micro-batches (forward/backward scales, the optimizer not)."""
        f = microbatches / max(1, self.microbatches)
        ops = Counter({k: v * (f if k[0] == "forward/backward" else 1.0) for k, v in self.ops.items()})
        return OpCounts(ops, self.graph_calls * f, self.extern_inside * f, microbatches)

    def lin(self, other: "OpCounts", scale: float) -> "OpCounts":
        """Linear extension in the number of blocks (trace.py): self + (other - self) x scale."""
        keys = self.ops.keys() | other.ops.keys()
        ops = Counter({k: self.ops[k] + (other.ops[k] - self.ops[k]) * scale for k in keys})
        return OpCounts(ops, self.graph_calls + (other.graph_calls - self.graph_calls) * scale,
                        self.extern_inside + (other.extern_inside - self.extern_inside) * scale, self.microbatches)

    def as_dict(self) -> dict[str, float]:
        """{"PHASE CLASS WHERE": operators, ..., "graph_calls", "extern_inside", "microbatches"}."""
        out = {f"{ph} {c} {w}": round(v, 1) for (ph, c, w), v in sorted(self.ops.items())}
        out.update(graph_calls=self.graph_calls, extern_inside=self.extern_inside, microbatches=self.microbatches)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> "OpCounts":
        ops = Counter({tuple(k.split(" ")): v for k, v in d.items() if k.count(" ") == 2})
        return cls(ops, d.get("graph_calls", 0.0), d.get("extern_inside", 0.0), int(d.get("microbatches", 1)))


def step_seconds(gpu_s: float, host_s: float) -> float:
    """The step time of a step of `gpu_s` GPU work that the host takes `host_s` to issue (module doc)."""
    return math.hypot(gpu_s, host_s)


def host_share(step_s: float, gpu_s: float) -> float:
    """The host time `step_seconds` needs to give a measured `step_s` with `gpu_s` of GPU work."""
    return math.sqrt(max(step_s * step_s - gpu_s * gpu_s, 0.0))


@dataclass
class HostTime:
    seconds: float
    breakdown: dict[str, float]
    """Seconds by what the host spends them on."""
    ops: float
    """Operators the host dispatches a step (every class, compiled graphs' insides left out)."""


def host_seconds(counts: OpCounts, dev: GPUSpec | None, compiled: bool) -> HostTime | None:
    """The host time of a step with these operator counts (see the module doc); None without host costs."""
    if dev is None or dev.host_op_us is None:
        return None
    us = {"kernel": dev.host_op_us, "alias": dev.host_alias_us, "handled": dev.host_handler_us}
    where = "outside" if compiled else None
    breakdown = {f"{cls} operators": counts.total(cls=cls, where=where) * us[cls] * 1e-6 for cls in CLASSES}
    ops = counts.total(cls="kernel", where=where) + counts.total(cls="alias", where=where)
    if compiled:
        kernels = 2 * counts.extern_inside + counts.graph_calls
        breakdown["compiled graph calls"] = counts.graph_calls * dev.host_op_us * 1e-6
        breakdown["compiled kernels' launches"] = kernels * dev.host_launch_us * 1e-6
        ops += counts.graph_calls
    return HostTime(sum(breakdown.values()), {k: v for k, v in breakdown.items() if v}, ops)


# ----------------------------------------------------------------------------- counting
class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active (see the module doc). `compiled`: the modules a
    compiling job compiles (their forward and the backward of what it built count as "inside").
    `phase` is set by the caller ("forward/backward", then "optimizer")."""

    def __init__(self, compiled: list[nn.Module] | None = None, cuda: bool = False) -> None:
        super().__init__()
        self.counts = OpCounts()
        self.phase = "forward/backward"
        self.cuda = cuda
        """The target runs `FUSED_ON_CUDA` calls fused (a GPU: `GPUSpec.fused_rms_norm`): they count as their
        CUDA kernels (see `functions`)."""
        self._fused_depth = 0
        self._fused_handled = False
        self._fused_inputs: list[set] = []
        self._fused_nodes: dict = {}  # autograd node -> the fused call that created it
        self._fused_done: set[int] = set()  # fused calls whose backward was counted
        self.regions = compiled is not None
        """Whether compiled regions are told apart (a compiling job)."""
        self._depth = 0
        self._inputs: list[set] = []
        self._nodes: set = set()
        self._keep: list = []  # the inside nodes stay alive while counting, so their identity is stable
        self._machinery: list[bool] = []
        self._hooks = []
        for module in compiled or []:
            self._hooks.append(module.register_forward_pre_hook(
                lambda module, args, kwargs: self.enter_region((args, kwargs)), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(
                lambda module, args, output: self.leave_region(output), prepend=True))

    def functions(self) -> TorchFunctionMode:
        """The torch-function mode to enter beside the counter (inside it): it sees `FUSED_ON_CUDA` calls."""
        return _FusedCalls(self)

    def _count(self, cls: str, handled: bool) -> None:
        where = "inside" if self.regions and self._inside() else "outside"
        self.counts.ops[(self.phase, cls, where)] += 1
        if handled:
            self.counts.ops[(self.phase, "handled", where)] += 1

    def fused_enter(self, inputs) -> None:
        self._fused_depth += 1
        self._fused_handled = False
        self._fused_inputs.append({t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None})

    def fused_leave(self, output) -> None:
        self._fused_depth -= 1
        stop = self._fused_inputs.pop()
        call = len(self._keep)
        self._count("kernel", self._fused_handled)  # the forward kernel
        for node in _nodes_between(output, stop, self._fused_nodes):
            self._fused_nodes[node] = call
            self._keep.append(node)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def compiled(self, fn, backward: bool = True):
        """`fn` (a compiled function, such as the loss) counted as a compiled region; `backward` False:
        a graph with no backward (the optimizer's update), whose call counts as one operator of its phase
        (it is not scaled with the micro-batches)."""
        if not backward:
            def launch(*args):
                self._count("kernel", False)
                self._depth += 1  # its insides run as one graph
                try:
                    return fn(*args)
                finally:
                    self._depth -= 1
            return launch

        def call(*args):
            self.enter_region(args)
            out = fn(*args)
            self.leave_region(out)
            return out
        return call

    # a compiled module's forward: between its own pre-hooks (FSDP's gather runs before) and post-hooks
    def enter_region(self, inputs) -> None:
        self._depth += 1
        self.counts.graph_calls += 2  # its forward graph now, its backward graph later
        self._inputs.append({t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None})

    def leave_region(self, output) -> None:
        self._depth -= 1
        stop = self._inputs.pop()
        for node in _nodes_between(output, stop, self._nodes):  # its backward is inside too
            self._nodes.add(node)
            self._keep.append(node)

    def _inside(self) -> bool:
        if any(self._machinery):  # FSDP's hooks run eagerly, also inside a compiled module's call
            return False
        if self._depth > 0:
            return True
        node = torch._C._current_autograd_node()
        return node is not None and node in self._nodes

    def _track_machinery(self, name: str, args) -> None:
        """FSDP2 marks its hooks with profiler ranges ("FSDP::pre_backward", ...): follow them."""
        if name.endswith("_record_function_enter_new"):
            self._machinery.append(bool(args) and isinstance(args[0], str) and args[0].startswith(MACHINERY))
        elif name.endswith("_record_function_exit") and self._machinery:
            self._machinery.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if self.regions and name.startswith("profiler."):
            self._track_machinery(name, args)
        if not name.startswith(IGNORED_NAMESPACES):
            handled = _issued_by_handler(sys._getframe(1))
            node = torch._C._current_autograd_node() if self._fused_nodes else None
            if self._fused_depth:  # a fused call's forward: counted once, when it returns
                self._fused_handled |= handled
            elif node is not None and node in self._fused_nodes:  # its backward: one kernel, once
                call = self._fused_nodes[node]
                if call not in self._fused_done:
                    self._fused_done.add(call)
                    self._count("kernel", handled)
            else:
                self._count(op_class(name), handled)
                if is_extern(name) and self.regions and self._inside():
                    self.counts.extern_inside += 1
        return func(*args, **(kwargs or {}))


class _FusedCalls(TorchFunctionMode):
    """Marks the `FUSED_ON_CUDA` calls for the counter (a target GPU only)."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (self.counter.cuda and getattr(func, "__name__", "") in FUSED_ON_CUDA
                and getattr(func, "__module__", "") == "torch.nn.functional"):
            return func(*args, **kwargs)
        self.counter.fused_enter((args, kwargs))
        out = func(*args, **kwargs)
        self.counter.fused_leave(out)
        return out


def _nodes_between(output, stop: set, seen) -> list:
    """The autograd nodes from `output`'s back to the inputs' (`stop`), parameters' accumulators left out."""
    out, found, todo = [], set(), [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen or node in stop or node in found or type(node).__name__ == "AccumulateGrad":
            continue
        out.append(node)
        found.add(node)
        todo += [n for n, _ in node.next_functions if n is not None]
    return out


def _issued_by_handler(frame) -> bool:
    """Whether the operator was called from a Python `__torch_dispatch__` (another mode's or a tensor
    subclass's) within a few frames."""
    f = frame.f_back if frame is not None else None
    for _ in range(8):
        if f is None:
            return False
        if f.f_code.co_name == "__torch_dispatch__":
            return True
        f = f.f_back
    return False


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
