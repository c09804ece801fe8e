"""Silent data corruption: the data-parallel replicas compared, or a forward run again where there are none
([fault] sdc_check_freq, docs/resilience.md).

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

Without replicas (pure FSDP, TP, CP: every rank holds its own shard) a check runs the step's first
micro-batch's forward again after its backward, on the same rank, weights and inputs, and compares the
logits' digests: the same kernels on the same bits give the same bits (deterministic kernels: on a CPU
always, on CUDA with `debug.deterministic`), so a difference is a wrong computation in one of the two. It
samples one forward per check: a fault that strikes elsewhere is missed, a unit that keeps computing wrong
is caught at its next check. Not under pipeline parallelism, nor for a model whose forward counts what it
sees (MoE balancing, module-added losses): the check says so once and is off.

Not caught: a corruption every replica shares (a wrong gradient before the all-reduce is summed into every
replica alike), one between the last check and a preemption's save, and, without replicas, one outside the
re-executed forward.
"""

from __future__ import annotations

import json
import os
import socket
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchtrain.config.fault import Fault
from torchtrain.config.job import Debug
from torchtrain.distributed.utils import local_part
from torchtrain.utils.logging import is_log_rank, logger

CHUNK = 1 << 21  # the period of the weights; words digested at a time (bounds the temporaries to 16 MiB)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CorruptionAbort(RuntimeError):
    """Raised on every rank when a check found a difference and the policy (or a missing checkpoint) stops the run."""


@dataclass
class Mismatch:
    """One tensor whose replicas (or whose re-execution) differ after `step`: the suspect global ranks and their
    digests."""

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
    if device not in _WEIGHTS:
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


def flip_bit(t: torch.Tensor) -> None:
    """Flip a low mantissa bit of the tensor's first value in place (a silent corruption nothing else notices)."""
    with torch.no_grad():
        local_part(t).reshape(-1)[:1].view(_BITS[t.element_size()]).bitwise_xor_(1 << (10 if t.element_size() >= 4 else 2))


class Reexecution:
    """One step's re-execution check (the step calls `first` and `again`, trainer/step.py's OutputCheck)."""

    def __init__(self, owner: "ReplicaCheck", step: int):
        self.owner, self.step, self.digest = owner, step, None

    def first(self, logits: torch.Tensor) -> None:
        flip = self.owner._flip
        if flip is not None and flip[0] == self.step and flip[1] == "output":
            self.owner._flip = None
            flip_bit(logits)
            logger.warning("step %d: rank %d flipped one bit of the first micro-batch's logits "
                           "(debug.inject_bitflip_step)", self.step, self.owner.rank)
        self.digest = digest(local_part(logits))

    def again(self, logits: torch.Tensor) -> None:
        first, again = self.digest.tolist(), digest(local_part(logits)).tolist()
        self.owner._differs = None if first == again else first + again


def listed_hosts(path: str | None) -> set[str]:
    """The hosts `fault.sdc_exclude_file` names (one per line; none without the file)."""
    return set(open(path).read().split()) if path and os.path.exists(path) else set()


def excluded_here(path: str | None) -> str | None:
    """Why this host must not start the job -- a replica check named it (`fault.sdc_exclude_file`) -- or None."""
    host = socket.gethostname()
    if host not in listed_hosts(path):
        return None
    return (f"this host ({host}) is listed in fault.sdc_exclude_file ({path}): a replica check named its devices in "
            f"silent data corruption. Start the job on other nodes (SLURM: --exclude=$(paste -sd, {path})), or "
            f"remove the line once the devices are checked")


class ReplicaCheck:
    """The trainer's check, in one of two modes. With replicas (`mesh`): `after_step` compares them when a check is
    due (every `sdc_check_freq` steps and before every checkpoint save: `saves_at`). Without (`reexecutable` steps:
    no pipeline, a forward without side effects): `output_check` has the step run its first micro-batch's forward
    again and `after_step` agrees whether any rank's logits differed. Both inject a test's bit flip when asked;
    `record` feeds the metrics."""

    def __init__(self, cfg: Fault, debug: Debug, mesh, compare_optimizer: bool, model_parts: list[nn.Module],
                 optimizers, run_folder: str, rank: int, device: torch.device, saves_at: Callable[[int], bool],
                 reexecutable: bool):
        self.mode = None if not cfg.sdc_check_freq else "replicas" if mesh is not None else \
            "reexecute" if reexecutable else None
        self.freq, self.policy, self.enabled = cfg.sdc_check_freq, cfg.sdc_policy, self.mode is not None
        self.mesh, self.model_parts, self.optimizers, self._saves_at = mesh, model_parts, optimizers, saves_at
        self.compare_optimizer = cfg.sdc_check_optimizer and compare_optimizer
        self.folder, self.rank, self.exclude_file = os.path.join(run_folder, "sdc"), rank, cfg.sdc_exclude_file
        self.device = device
        self.checks = self.mismatches = 0
        self._differs = None  # re-execution: this rank's (first, again) digests when they differed this step
        flip = debug.inject_bitflip_step
        self._flip = (flip, debug.inject_bitflip_target) if flip is not None and rank == debug.inject_bitflip_rank \
            else None
        if not is_log_rank() or not cfg.sdc_check_freq:
            return
        if self.mode == "replicas":
            logger.info("silent data corruption check: replicas compared every %d steps and before each save "
                        "(parameters%s; policy %s)", self.freq, " and optimizer state" if self.compare_optimizer
                        else "", cfg.sdc_policy)
        elif self.mode == "reexecute":
            logger.info("silent data corruption check: no data-parallel replicas, so every %d steps and before each "
                        "save the first micro-batch's forward runs again and its logits are compared bitwise "
                        "(policy %s)", self.freq, cfg.sdc_policy)
        else:
            logger.warning("fault.sdc_check_freq: this layout has no data-parallel replicas to compare and its step "
                           "cannot run a forward again (pipeline parallelism, or a model whose forward counts what "
                           "it sees: MoE, multi-token prediction); the check is off")

    # ------------------------------------------------------------------ what a rank holds
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, local tensor) of every parameter, then of every optimizer state tensor, in a fixed order."""
        out, names = [], {}
        for i, part in enumerate(self.model_parts):
            for name, p in part.named_parameters():
                label = name if len(self.model_parts) == 1 else f"part{i}.{name}"
                names[id(p)] = label
                out.append((label, local_part(p)))
        if self.compare_optimizer:
            for opt in self.optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        for key, value in sorted(opt.state.get(p, {}).items()):
                            if isinstance(value, torch.Tensor):
                                out.append((f"optimizer {key} of {names.get(id(p), '?')}", local_part(value)))
        return out

    # ------------------------------------------------------------------ the step's part
    @property
    def _differ(self) -> str:
        return "the data-parallel replicas differ" if self.mode == "replicas" else "a forward run again differs"

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.freq == 0 or self._saves_at(step))

    def output_check(self, step: int) -> "Reexecution | None":
        """The step's re-execution check (trainer/step.py's OutputCheck), when due in that mode."""
        return Reexecution(self, step) if self.mode == "reexecute" and self.due(step) else None

    def after_step(self, step: int) -> list[Mismatch]:
        """After the optimizer step: the test's bit flip, then the check if due (identical on every rank)."""
        if self._flip is not None and self._flip[0] == step and self._flip[1] != "output":
            self._inject(step, self._flip[1])
        if not self.due(step):
            return []
        self.checks += 1
        if self.mode == "replicas":
            found, reporter = self.check(step)
        else:
            differs, self._differs = self._differs, None
            found = [] if differs is None else [Mismatch(step, "the first micro-batch's output (logits), computed "
                                                               "again", [self.rank], {self.rank: differs})]
            reporter = True
        return self._agree(step, found, reporter)

    def _inject(self, step: int, target: str) -> None:
        self._flip = None  # once: a step run again after a rollback is clean
        name, t = next((n, t) for n, t in self.tensors() if t.numel() and t.is_floating_point() and
                       (target == "param") == (not n.startswith("optimizer ")))
        flip_bit(t)
        logger.warning("step %d: rank %d flipped one bit of %s (debug.inject_bitflip_step)", step, self.rank, name)

    def check(self, step: int) -> tuple[list[Mismatch], bool]:
        """Compare this rank's tensors with its replicas': (the group's findings, whether this rank reports them)."""
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
            return [Mismatch(step, "the list of tensors held", ranks, {r: s.tolist() for r, s in zip(ranks, shapes)})], \
                self.rank == min(ranks)
        gathered = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(gathered, mine, group=group)
        return compare(names, torch.stack(gathered).cpu(), ranks, step), self.rank == min(ranks)

    def _agree(self, step: int, found: list[Mismatch], reporter: bool) -> list[Mismatch]:
        """Every rank learns whether any rank found a difference (one all-reduce), and only then every finding
        (one gather of objects); re-execution findings of several ranks merge into one."""
        flag = torch.tensor([1 if found else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank takes the same branch
        if not flag.item():
            return []
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (socket.gethostname(), [asdict(m) for m in found] if reporter else []))
        everything = [Mismatch(**m) for _, report in reports for m in report]
        if self.mode == "reexecute":
            everything = [Mismatch(step, everything[0].tensor, [r for m in everything for r in m.ranks],
                                   {k: v for m in everything for k, v in m.digests.items()})]
        self.mismatches += len(everything)
        self._report(step, everything, {r: reports[r][0] for m in everything for r in m.ranks})
        return everything

    def _report(self, step: int, found: list[Mismatch], hosts: dict[int, str]) -> None:
        """The log line, the evidence file, and the suspect hosts added to `sdc_exclude_file` (log rank only)."""
        if not is_log_rank():
            return
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"step-{step}.json")
        with open(path, "w") as f:
            json.dump({"step": step, "hosts": hosts, "mismatches": [asdict(m) for m in found]}, f, indent=1)
        shown = "; ".join(m.describe() for m in found[:5]) + (f"; ... ({len(found)} in all)" if len(found) > 5 else "")
        logger.warning("sdc: after step %d %s: %s (evidence: %s)", step, self._differ, shown, path)
        if self.exclude_file:
            new = sorted(set(hosts.values()) - listed_hosts(self.exclude_file))
            with open(self.exclude_file, "a") as f:
                f.writelines(f"{host}\n" for host in new)
            logger.warning("sdc: suspect host(s) %s listed in %s (fault.sdc_exclude_file)",
                           ", ".join(sorted(set(hosts.values()))), self.exclude_file)

    def abort_message(self, step: int, found: list[Mismatch]) -> str:
        why = 'fault.sdc_policy is "abort"' if self.policy == "abort" else "there is no checkpoint to roll back to yet"
        more = ", ..." if len(found) > 1 else ""
        return (f"after step {step} {self._differ} ({found[0].describe()}{more}); {why}. The "
                f"evidence is in {os.path.join(self.folder, f'step-{step}.json')}: check the named ranks' devices "
                f"before resuming from the newest checkpoint")

    def record(self) -> dict[str, int]:
        """Metrics fields (none when the check is off)."""
        return {"sdc_checks": self.checks, "sdc_mismatches": self.mismatches} if self.enabled else {}
