"""Per-step figures of a torch.profiler chrome trace of training steps (torchtrain's or torchtitan's).

    python benchmarks/gpu/trace_stats.py TRACE.json[.gz] [TRACE2 ...] [--json]

For each trace: the recorded steps (the host-side `ProfilerStep#N` annotations; the GPU-side copies of
those annotations are not steps), and per step

* step s            the host-side duration of a profiled step (the profiler slows the host: compare
                    with the unprofiled steps of the same run);
* kernels           GPU kernels, memcpys and memsets launched inside the recorded steps (a kernel goes with
                    the step whose host range holds its launch, by the launch's correlation id: the host
                    may queue a step while the GPU still runs the one before);
* GPU busy s        the union of their intervals (the time the GPU had work);
* kernel s by kind  GEMM, attention, element-wise, reduction, copy, optimizer, other: a kernel launched
                    inside an optimizer's step (torch's `Optimizer.step#...` annotation, linked to the
                    kernel by the launch's correlation id) is the optimizer's whatever its name (a
                    compiled step's Triton kernels), the others go by name (Inductor's `triton_tem_`
                    templates are GEMMs, `triton_red_`/`triton_per_` reductions, `triton_poi_`
                    element-wise);
* host launches     cudaLaunchKernel / cuLaunchKernelEx calls inside the steps and their mean host duration;
* profiler ops      every `aten::` (and `c10d::`, `fsdp::`) operator event, nested calls included;
* dispatched ops    the operators a dispatch-level observer (a `TorchDispatchMode`, which is what the
                    planner's traced step counts) sees: an operator event counts unless it is
                    CompositeImplicitAutograd (it decomposes into others before dispatch; unless the
                    profile shows it reaching a Python dispatch handler whole) or it runs inside another
                    counted operator; the operator that enters a Python dispatch mode
                    (activation checkpointing's policy: a `PythonDispatchMode` event) hands its count
                    to the call the mode re-dispatches. `detach` events count as `aten::detach`;
* GEMMs by shape    the GEMM kernels' time by the M x K x N of the operator that launched them (its
                    recorded input shapes; the kernel's External id links them) and the TFLOP/s each
                    shape reached;
* mode calls        Python dispatch-mode calls (`PythonDispatchMode` events): selective activation
                    checkpointing's policy sees every forward and recomputed operator of a block.

The dispatched-op count needs torch (the operator registry says which operators are composite).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from dataclasses import dataclass, field

OP_PREFIXES = ("aten::", "c10d::", "fsdp::", "_c10d_functional::", "prims::")
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kind(name: str) -> str:
    n = name.lower()
    if "multi_tensor_apply" in n or "fused_adam" in n:
        return "optimizer"
    if n.startswith("triton_"):  # Inductor's kernels: template (a GEMM), reduction, persistent reduction, pointwise
        return "gemm" if n.startswith("triton_tem_") else "reduction" if n.startswith(("triton_red_", "triton_per_")) \
            else "element-wise"
    if any(k in n for k in ("flash", "fmha", "sdpa", "cudnn", "attention")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "wgmma")):
        return "gemm"
    if "memcpy" in n or "memset" in n or "chunk_cat" in n or "copy" in n:
        return "copy"
    if "reduce" in n or "softmax" in n:
        return "reduction"
    if "elementwise" in n or "triton" in n:
        return "element-wise"
    return "other"


_COMPOSITE: dict[str, bool] = {}


def composite(name: str) -> bool:
    """Whether every functional overload of the operator is CompositeImplicitAutograd (and the profile
    did not show it dispatched whole)."""
    if name in _DISPATCHED_WHOLE:
        return False
    if name not in _COMPOSITE:
        import torch

        ns, op = name.split("::", 1)
        kinds = []
        packet = getattr(getattr(torch.ops, ns, None), op, None) if hasattr(torch.ops, ns) else None
        for overload in (packet.overloads() if packet is not None else []):
            if "out" in overload:
                continue
            try:
                qualified = getattr(packet, overload).name()
                kinds.append(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"))
            except (RuntimeError, AttributeError):
                continue  # a TorchScript-only overload
        _COMPOSITE[name] = bool(kinds) and all(kinds)
    return _COMPOSITE[name]


HANDLERS = ("PythonDispatchMode", "PythonSubclass")
"""Profiler events of a Python `__torch_dispatch__` (a dispatch mode's; a tensor subclass's)."""


@dataclass
class Dispatched:
    """The dispatched operators of a trace (see the module doc), with what the host spent on them."""

    names: collections.Counter = field(default_factory=collections.Counter)
    classes: collections.Counter = field(default_factory=collections.Counter)
    """kernel | alias -> operators (host_time.op_class); "handled" -> those of them issued inside a handler."""
    class_us: collections.Counter = field(default_factory=collections.Counter)
    """The same -> summed durations of those operator events (their nested calls included), us."""
    handler_self_us: float = 0.0
    """Time inside handler events outside any operator they issued, us."""
    handler_calls: int = 0
    profiler_ops: int = 0


def dispatched_ops(events: list[dict]) -> Dispatched:
    """Count the dispatched operators over all threads (see the module doc)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = Dispatched()
    out.profiler_ops = sum(1 for t in by_thread.values() for e in t if e["name"].startswith(OP_PREFIXES))
    roots = []
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        root: dict = {"name": "", "dur": 0.0, "children": []}
        stack = [(float("inf"), root)]
        for e in thread:  # the nesting tree of the thread's events
            while stack[-1][0] <= e["ts"]:
                stack.pop()
            node = {"name": e["name"], "dur": e["dur"], "children": []}
            if e["name"] in HANDLERS:  # the operator above reached the Python dispatch key whole
                _DISPATCHED_WHOLE.add(stack[-1][1]["name"])
            stack[-1][1]["children"].append(node)
            stack.append((e["ts"] + e["dur"], node))
        roots.append(root)
    for root in roots:
        _count(root, False, False, out)
    return out


_DISPATCHED_WHOLE: set[str] = set()
"""Operators seen entering a Python dispatch handler in a profile: dispatched as themselves on the device
that ran it, whatever this build's registry says (`_fused_rms_norm` has a CUDA kernel of its own; a
CPU-only build registers it as a composite)."""


def _count(node: dict, inside: bool, handled: bool, out: Dispatched) -> bool:
    """Count `node`'s subtree into `out`; True when a handler in it re-dispatched operators that were
    counted (the enclosing counted operator then hands its count over to them)."""
    from torchtrain.planner.host_time import op_class

    if node["name"] in HANDLERS:
        before = sum(out.names.values())
        out.handler_calls += 1
        out.handler_self_us += node["dur"] - sum(c["dur"] for c in node["children"])
        for child in node["children"]:
            _count(child, False, True, out)
        return sum(out.names.values()) > before
    name = "aten::detach" if node["name"] == "detach" else node["name"]
    counted = name.startswith(OP_PREFIXES) and not inside and not composite(name)
    redispatched = False
    for child in node["children"]:
        redispatched |= _count(child, inside or counted, handled, out)
    if counted:
        if not redispatched:
            cls = op_class(name)
            out.names[name] += 1
            out.classes[cls] += 1
            out.class_us[cls] += node["dur"]
            out.classes["handled"] += handled
        return False
    return redispatched


def host_costs(summary: dict, step_s: float) -> dict[str, float]:
    """Per-operator host costs (us) from one profiled program's summary (`summarize`) and its unprofiled
    step time `step_s`. The profile gives each class's mean duration -- operators with their nested calls
    and launches; for handled operators the handlers' own Python time per operator they issued. The
    host's share of the unprofiled step is what the planner's step model (`host_time.step_seconds`) needs
    beside the profile's GPU busy time to give `step_s` (`host_time.host_share`); each mean is scaled so
    that the counted operators of one step add up to it (`profile_scale`: ~1 when the profile's own
    durations explain the step)."""
    from torchtrain.planner.host_time import host_share

    n, mean = summary["dispatched_by_class_per_step"], summary["mean_us_by_class"]
    handler_us = summary["handler_self_s_per_step"] * 1e6
    host_s = host_share(step_s, summary["gpu_busy_s_per_step"])
    scale = host_s * 1e6 / (n["kernel"] * mean["kernel"] + n["alias"] * mean["alias"] + handler_us)
    return {"host_op_us": round(mean["kernel"] * scale, 1), "host_alias_us": round(mean["alias"] * scale, 1),
            "host_handler_us": round(handler_us / n["handled"] * scale, 1),
            "host_launch_us": round(summary["launch_host_us_mean"], 1), "profile_scale": round(scale, 3)}


LAUNCHES_DRIVER = ("cuLaunchKernelEx", "cuLaunchKernel")
"""Driver-API launches (Triton's kernels, compiled graphs' templates)."""


def optimizer_correlations(events: list[dict]) -> set:
    """Correlation ids of the CUDA API calls made inside an optimizer's step (torch annotates every
    `Optimizer.step` with `Optimizer.step#<class>.step`) on the thread that ran it."""
    ranges = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("Optimizer.step#") \
                and e.get("cat") in ("user_annotation", "cpu_op"):
            ranges[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
    found = set()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            if any(s <= e["ts"] <= t for s, t in ranges.get((e.get("pid"), e.get("tid")), ())):
                found.add(e["args"]["correlation"])
    return found


GEMM_OPS = {"aten::mm": 0, "aten::addmm": 1, "aten::_scaled_mm": 0, "aten::bmm": 0}
"""Operators whose kernels are GEMMs -> the index of their first matrix in `Input Dims` (addmm: the bias first)."""


def host_calls_in(steps: list[dict], events: list[dict]) -> list[dict]:
    """The CUDA runtime and driver calls made inside one of the host-side `steps` (all of them when the trace
    has no steps)."""
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    return [e for e in calls if not steps or any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)]


def launched_in(calls: list[dict], kernels: list[dict]) -> list[dict]:
    """The `kernels` launched by one of the host `calls` (linked by correlation id)."""
    inside = {e.get("args", {}).get("correlation") for e in calls}
    return [e for e in kernels if e.get("args", {}).get("correlation") in inside]


def gemm_by_shape(events: list[dict], kernels: list[dict], n_steps: int) -> list[dict]:
    """The GEMM kernels' time a step by the shape of the operator that launched them (M x K x N, from the
    profile's recorded input shapes, linked by the kernel's External id), largest first, with the
    TFLOP/s each shape reached: where a step's matmul time goes, and which shapes run below the rest."""
    ops = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("name") in GEMM_OPS:
            dims = e.get("args", {}).get("Input Dims") or []
            first = GEMM_OPS[e["name"]]
            if len(dims) >= first + 2 and len(dims[first]) >= 2 and len(dims[first + 1]) >= 2:
                a, b = dims[first], dims[first + 1]
                batch = a[0] if len(a) == 3 else 1
                types = e["args"].get("Input type") or [""]
                ops[e["args"].get("External id")] = (batch * a[-2], a[-1], b[-1], str(types[first]).split("::")[-1])
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        if e.get("cat") == "kernel":
            key = ops.get(e.get("args", {}).get("External id"))
            if key is not None:
                by[key][0] += 1
                by[key][1] += e["dur"]
    n = max(1, n_steps)
    return [{"shape": f"{m}x{k}x{nn}", "dtype": dt, "calls_per_step": round(c / n, 1),
             "ms_per_step": round(us / 1e3 / n, 3), "tflops": round(2 * m * k * nn * c / (us * 1e-6) / 1e12)}
            for (m, k, nn, dt), (c, us) in sorted(by.items(), key=lambda kv: -kv[1][1]) if us > 0]


def kernels_by_name(kernels: list[dict], n_steps: int, top: int = 16) -> list[dict]:
    """The kernels' time a step by kernel name (its first 100 characters), largest first, with the calls a step
    and the mean microseconds a call: the same kernel compared across two traces shows whether the same work
    ran at the same pace."""
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        entry = by[e["name"][:100]]
        entry[0] += 1
        entry[1] += e["dur"]
    n = max(1, n_steps)
    return [{"kernel": name, "kind": kind(name), "calls_per_step": round(c / n, 1), "ms_per_step": round(us / 1e3 / n, 3),
             "us_per_call": round(us / c, 1)} for name, (c, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]]


def summarize(path: str) -> dict:
    events = load(path)
    steps = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    n = max(1, len(steps))
    calls = host_calls_in(steps, events)
    kernels = launched_in(calls, [e for e in events if e.get("ph") == "X" and e.get("cat") in KERNEL_CATS])
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, start, end = 0.0, None, None
    for s, t in intervals:
        if start is None or s > end:
            busy += 0.0 if start is None else end - start
            start, end = s, t
        else:
            end = max(end, t)
    busy += 0.0 if start is None else end - start
    by_kind: collections.Counter = collections.Counter()
    in_optimizer = optimizer_correlations(events)
    for e in kernels:
        by_kind["optimizer" if e.get("args", {}).get("correlation") in in_optimizer else kind(e["name"])] += e["dur"]
    launches = [e for e in calls if e.get("name") in (("cudaLaunchKernel",) if e["cat"] == "cuda_runtime"
                                                     else LAUNCHES_DRIVER)]
    d = dispatched_ops(events)
    return {
        "trace": path.rsplit("/", 1)[-1], "steps": [e["name"] for e in steps],
        "step_s": [round(e["dur"] / 1e6, 4) for e in steps],
        "kernels_per_step": round(len(kernels) / n, 1),
        "gpu_busy_s_per_step": round(busy / 1e6 / n, 4),
        "kernel_s_per_step_by_kind": {k: round(v / 1e6 / n, 4) for k, v in by_kind.most_common()},
        "launches_per_step": round(len(launches) / n, 1),
        "launch_host_us_mean": round(sum(e["dur"] for e in launches) / max(1, len(launches)), 3),
        "profiler_ops_per_step": round(d.profiler_ops / n, 1),
        "dispatched_ops_per_step": round((d.classes["kernel"] + d.classes["alias"]) / n, 1),
        "dispatched_by_class_per_step": {k: round(v / n, 1) for k, v in sorted(d.classes.items())},
        "mean_us_by_class": {k: round(d.class_us[k] / v, 3) for k, v in sorted(d.classes.items()) if k != "handled"},
        "handler_calls_per_step": round(d.handler_calls / n, 1),
        "handler_self_s_per_step": round(d.handler_self_us / 1e6 / n, 6),
        "top_dispatched_ops_per_step": {k: round(v / n, 1) for k, v in d.names.most_common(12)},
        "gemm_by_shape": gemm_by_shape(events, kernels, len(steps)),
        "kernels_by_name": kernels_by_name(kernels, len(steps)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--step-s", type=float, action="append",
                    help="the unprofiled step time of a trace's run (once per trace, in order): derive the "
                         "per-operator host costs of the device table from it (host_costs)")
    args = ap.parse_args(argv)
    if args.step_s and len(args.step_s) != len(args.traces):
        ap.error("give --step-s once per trace")
    out = []
    for i, path in enumerate(args.traces):
        summary = summarize(path)
        if args.step_s:
            summary["unprofiled_step_s"] = args.step_s[i]
            summary["host_costs_us"] = host_costs(summary, args.step_s[i])
        out.append(summary)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for s in out:
        print(f"{s['trace']}: {len(s['steps'])} steps, profiled step s {s['step_s']}")
        for key, value in s.items():
            if key == "gemm_by_shape":
                for g in value:
                    print(f"  GEMM {g['shape']:>22s} {g['dtype']:9s} {g['calls_per_step']:6g}/step "
                          f"{g['ms_per_step']:8.3f} ms/step {g['tflops']:5d} TFLOP/s")
            elif key == "kernels_by_name":
                for k in value:
                    print(f"  kernel {k['ms_per_step']:8.3f} ms/step {k['calls_per_step']:6g}/step "
                          f"{k['us_per_call']:9.1f} us/call  {k['kind']:12s} {k['kernel']}")
            elif key not in ("trace", "steps", "step_s"):
                text = ", ".join(f"{k} {v:g}" for k, v in value.items()) if isinstance(value, dict) else value
                print(f"  {key:30s} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
