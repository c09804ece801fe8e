"""Silent data corruption: the data-parallel replicas compared ([fault] sdc_check_freq, docs/resilience.md).

Replicas hold bitwise-equal values. Their gradients come out of one all-reduce (every rank receives the
same sum), and the optimizer step is the same element-wise arithmetic on the same inputs, so the
parameters and the optimizer state stay equal bit for bit. A device that computes a wrong value without
an error (a flipped bit in a register or in memory) breaks that equality in one replica; comparing the
replicas finds it. Which ranks are replicas is the resolved layout's decision (`Layout.replica_mesh`).

The digest of a tensor is exact and does not depend on the order of a reduction: its bytes read as
little-endian 64-bit integers b_i, and the last bytes that do not fill a word as signed bytes c_j, and two
sums modulo 2^64 (int64 arithmetic, wrapping),

    S = sum_i b_i + sum_j c_j        W = sum_i w_i b_i + sum_j w_j c_j,   w_i = 2 (i mod 2^21) + 1.

A change of one value changes one or two words b_i, each by d != 0 modulo 2^64, so S changes unless
changes cancel; W weights each position by an odd number, so d w_i != 0 modulo 2^64 for a single change,
and changes that cancel in S (a swap, say) still show. Integer sums give the same digest for the same bytes
on any device, kernel or thread count. Cost: the tensor read twice, the cached weights read once and a
product written and read: about 4 times one copy of the tensor on a CPU (benchmarks/sdc_check.py).

A check: each rank digests the tensors it holds (parameters, then optimizer state, in a fixed order), the
replica group all-gathers the digests (16 bytes a tensor), and every rank compares them; for each tensor
where the replicas differ, the ranks outside the majority are named (all of them when there is no
majority: with two replicas nobody can tell which one is right). All ranks then agree (one all-reduce)
whether any group found a difference, and only then gather the findings on the log rank, which logs them
and writes `{dump_folder}/sdc/step-N.json`. What to do next is the policy's (`sdc_policy`, the trainer).

Not caught: a corruption every replica shares (a wrong gradient before the all-reduce is summed into every
replica alike), one in a layout without replicas, one between the last check and a preemption's save.
"""

from __future__ import annotations

import json
import os
import socket
import zlib
from collections import Counter
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from torchtrain.config.fault import Fault
from torchtrain.config.job import Debug
from torchtrain.utils.logging import is_log_rank, logger

CHUNK = 1 << 21  # the period of the weights; words digested at a time (bounds the temporaries to 16 MiB)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CorruptionAbort(RuntimeError):
    """Raised on every rank when the replicas differ and the policy (or a missing checkpoint) stops the run."""


@dataclass
class Mismatch:
    """One tensor whose replicas differ after `step`: the suspect global ranks and every replica's digest."""

    step: int
    tensor: str
    ranks: list[int]
    digests: dict[int, list[int]]

    def describe(self) -> str:
        return f"{self.tensor} on rank(s) {', '.join(map(str, self.ranks))}"


def digest(t: torch.Tensor) -> torch.Tensor:
    """(S, W) of the tensor's bytes as an int64 pair on its device (the module doc)."""
    raw = t.detach().reshape(-1)
    if raw.dtype != torch.uint8:
        raw = raw.view(_BITS[raw.element_size()]).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # not 8-byte aligned in its storage: copied first
        words = raw[:whole].clone().view(torch.int64)
    s = torch.zeros((), dtype=torch.int64, device=raw.device)
    w = torch.zeros((), dtype=torch.int64, device=raw.device)
    weights = _weights(raw.device)
    for start in range(0, words.numel(), CHUNK):
        b = words[start:start + CHUNK]
        s += b.sum()
        w += (b * weights[:b.numel()]).sum()
    if whole < raw.numel():  # the last bytes, one integer each
        tail = raw[whole:].view(torch.int8).to(torch.int64)
        s += tail.sum()
        w += (tail * weights[:tail.numel()]).sum()
    return torch.stack([s, w])


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """w_i = 2 i + 1 for i < CHUNK, int64, made once per device."""
    if device not in _WEIGHTS or _WEIGHTS[device].numel() != CHUNK:
        _WEIGHTS[device] = torch.arange(CHUNK, dtype=torch.int64, device=device).mul_(2).add_(1)
    return _WEIGHTS[device]


def compare(names: list[str], digests: torch.Tensor, ranks: list[int], step: int) -> list[Mismatch]:
    """`digests[r, j]`: replica r's digest of tensor j (host tensor, [R, n, 2]); the tensors where they differ."""
    found = []
    for j, name in enumerate(names):
        values = [tuple(digests[r, j].tolist()) for r in range(len(ranks))]
        if len(set(values)) == 1:
            continue
        common, count = Counter(values).most_common(1)[0]
        majority = count * 2 > len(ranks)
        suspects = [rank for rank, v in zip(ranks, values) if not majority or v != common]
        found.append(Mismatch(step, name, suspects, {rank: list(v) for rank, v in zip(ranks, values)}))
    return found


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a (maybe distributed) tensor this rank holds."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ReplicaCheck:
    """The trainer's check: `after_step` injects a test's bit flip when asked, and compares the replicas when a
    check is due (every `sdc_check_freq` steps and before every checkpoint save); `record` feeds the metrics."""

    def __init__(self, cfg: Fault, debug: Debug, mesh, compare_optimizer: bool, model_parts: list[nn.Module],
                 optimizers, run_folder: str, rank: int):
        self.freq, self.policy = (cfg.sdc_check_freq if mesh is not None else 0), cfg.sdc_policy
        self.enabled = self.freq > 0
        if cfg.sdc_check_freq and mesh is None and is_log_rank():
            logger.warning("fault.sdc_check_freq: this layout has no data-parallel replicas (every rank holds its own "
                           "shard: FSDP, TP, PP or one process), so there is nothing to compare; the check is off")
        self.mesh, self.model_parts, self.optimizers = mesh, model_parts, optimizers
        self.compare_optimizer = cfg.sdc_check_optimizer and compare_optimizer
        self.folder, self.rank = os.path.join(run_folder, "sdc"), rank
        self.checks = self.mismatches = 0
        flip = debug.inject_bitflip_step
        self._flip = (flip, debug.inject_bitflip_target) if flip is not None and rank == debug.inject_bitflip_rank \
            else None
        if self.enabled and is_log_rank():
            logger.info("silent data corruption check: replicas compared every %d steps and before each save "
                        "(parameters%s; policy %s)", self.freq, " and optimizer state" if self.compare_optimizer
                        else "", cfg.sdc_policy)

    # ------------------------------------------------------------------ what a rank holds
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, local tensor) of every parameter, then of every optimizer state tensor, in a fixed order."""
        out, names = [], {}
        for i, part in enumerate(self.model_parts):
            for name, p in part.named_parameters():
                label = name if len(self.model_parts) == 1 else f"part{i}.{name}"
                names[id(p)] = label
                out.append((label, local(p)))
        if self.compare_optimizer:
            for opt in self.optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        for key, value in sorted(opt.state.get(p, {}).items()):
                            if isinstance(value, torch.Tensor):
                                out.append((f"optimizer {key} of {names.get(id(p), '?')}", local(value)))
        return out

    # ------------------------------------------------------------------ the step's part
    def after_step(self, step: int, saving: bool) -> list[Mismatch]:
        """After the optimizer step: the test's bit flip, then the check if due (identical on every rank)."""
        if self._flip is not None and self._flip[0] == step:
            self._inject(step, self._flip[1])
        if not self.enabled or not (step % self.freq == 0 or saving):
            return []
        return self.check(step)

    def _inject(self, step: int, target: str) -> None:
        self._flip = None  # once: a step run again after a rollback is clean
        name, t = next((n, t) for n, t in self.tensors() if t.numel() and t.is_floating_point() and
                       (target == "param") == (not n.startswith("optimizer ")))
        with torch.no_grad():
            bits = t.reshape(-1)[:1].view(_BITS[t.element_size()])
            bits.bitwise_xor_(1 << (10 if t.element_size() >= 4 else 2))  # a low mantissa bit: nothing else notices
        logger.warning("step %d: rank %d flipped one bit of %s (debug.inject_bitflip_step)", step, self.rank, name)

    def check(self, step: int) -> list[Mismatch]:
        """Compare this rank's tensors with its replicas'; every rank returns every group's findings."""
        held = self.tensors()
        names = [n for n, _ in held]
        mine = torch.stack([digest(t) for _, t in held]) if held else torch.zeros(0, 2, dtype=torch.int64)
        group = self.mesh.get_group()
        ranks = dist.get_process_group_ranks(group)
        shape = torch.tensor([len(names), zlib.crc32("\n".join(names).encode())], dtype=torch.int64,
                             device=mine.device)
        shapes = [torch.empty_like(shape) for _ in ranks]
        dist.all_gather(shapes, shape, group=group)
        if len({tuple(s.tolist()) for s in shapes}) > 1:
            found = [Mismatch(step, "the list of tensors held", ranks, {r: s.tolist() for r, s in zip(ranks, shapes)})]
        else:
            gathered = [torch.empty_like(mine) for _ in ranks]
            dist.all_gather(gathered, mine, group=group)
            found = compare(names, torch.stack(gathered).cpu(), ranks, step)
        self.checks += 1
        flag = torch.tensor([1 if found else 0], device=mine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank takes the same branch
        if not flag.item():
            return []
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, [asdict(m) for m in found] if self.rank == min(ranks) else [])
        everything = [Mismatch(**m) for report in reports for m in report]
        self.mismatches += len(everything)
        self._report(step, everything)
        return everything

    def _report(self, step: int, found: list[Mismatch]) -> None:
        if not is_log_rank():
            return
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"step-{step}.json")
        with open(path, "w") as f:
            json.dump({"step": step, "host": socket.gethostname(), "mismatches": [asdict(m) for m in found]}, f,
                      indent=1)
        shown = "; ".join(m.describe() for m in found[:5]) + (f"; ... ({len(found)} in all)" if len(found) > 5 else "")
        logger.warning("sdc: after step %d the data-parallel replicas differ: %s (evidence: %s)", step, shown, path)

    def abort_message(self, step: int, found: list[Mismatch]) -> str:
        why = 'fault.sdc_policy is "abort"' if self.policy == "abort" else "there is no checkpoint to roll back to yet"
        more = ", ..." if len(found) > 1 else ""
        return (f"after step {step} the data-parallel replicas differ ({found[0].describe()}{more}); {why}. The "
                f"evidence is in {os.path.join(self.folder, f'step-{step}.json')}: check the named ranks' devices "
                f"before resuming from the newest checkpoint")

    def record(self) -> dict[str, int]:
        """Metrics fields (none when the check is off)."""
        return {"sdc_checks": self.checks, "sdc_mismatches": self.mismatches} if self.enabled else {}
