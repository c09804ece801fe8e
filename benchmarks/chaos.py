"""Chaos: one deterministic training job under a seeded schedule of faults injected from outside while it
runs; it must end with the losses of the uninterrupted run, bitwise.

    python benchmarks/chaos.py [--nproc 4] [--steps 400] [--interval 10] [--seed 0] [--faults all] [--count 20]
                               [--folder /tmp/torchtrain-chaos]

The job (HSDP over `--nproc` CPU processes under the launcher: two replicas, compared every 5 steps and before each
save; the tiny model, deterministic kernels, a checkpoint every `--interval` steps, keep_latest_k 3,
fault.max_restarts 40, hang_timeout_s 4, a straggler comparison every 10 steps, guard.policy rollback with
rollback_replay) runs once undisturbed
(the reference) and once under the schedule. The faults, in an order and at steps drawn from `--seed`:

  kill9     kill -9 of one rank: torchrun restarts the workers, they resume from the newest checkpoint
  sigstop   SIGSTOP of one rank: the hang monitor declares the hang, the workers exit 4 and are restarted
  preempt   SIGTERM to every process of the launch, then the same command again
  enospc    one rank's next checkpoint write fails as on a full disk (injected ENOSPC, the file cut short)
  flip      a flipped byte in a shard of the newest checkpoint, then kill -9 of one rank (the restart loads)
  truncate  a shard of the newest checkpoint cut short, then kill -9 of every process of the launch (a
            lost node) and the same command again
  slow      one rank computes 0.3 s more per step for 25 steps
  nonfinite +inf in one rank's gradient at its next step
  node      kill -9 of two ranks at once (a lost node)
  sdc       one bit of one replica's parameter flipped after a backward (silent data corruption): the replicas'
            comparison names it at the next check and the run rolls back to the newest checkpoint
  rendezvous kill -9 of one rank, then of a restarted worker while the new attempt starts (its process group,
            its checkpoint load): the restart itself fails and is restarted again

`--count` faults in all (default 20): every kind once, the rest drawn from the kinds, in a seeded order. The
report (`{folder}/report.json`, and a timeline picture `{folder}/timeline.svg`) gives each fault's timeline --
injected, detected, back at the step it had reached (seconds from the chaos run's start) -- and the run's
**goodput**: useful step time (the final steps at a healthy step's time) over the wall time, beside the
reference's (start-up alone).

The slow rank, the gradient and the failing write are requested through a control folder that the
test plugin (tests/plugins/fault_injection.py, loaded with job.custom_imports) reads; the job and its
launches are benchmarks/chaos_job.py. For each fault the
benchmark prints how it was detected (the log line), the action taken, and what it cost: the seconds
from the injection until the run is back at the step it had reached, less one healthy step; the steps
trained again. Then it checks that the final weights and optimizer state (the last checkpoint's tensors) and the
final losses equal the reference bitwise (each step's latest
logged loss) and that no step's loss was ever logged with two different values -- but the steps a silently
corrupted replica trained before the check caught it, which by their nature log the corrupted loss; exit status 1
if not.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import re
import shutil
import signal
import statistics
import sys
import time

import chaos_report
from chaos_job import HANG_S, Record, Run, final_tensors, job, same_tensors
from chaos_report import Outcome

FAULTS = ("kill9", "sigstop", "preempt", "enospc", "flip", "truncate", "slow", "nonfinite", "node", "sdc", "rendezvous")
SLOW_S, SLOW_STEPS = 0.3, 25


class Chaos:
    def __init__(self, run: Run, interval: int, rng: random.Random):
        self.run, self.interval, self.rng = run, interval, rng
        self.step_s = 0.0  # a healthy step's wall time, measured before the first fault
        self.back_at: float | None = None  # when the run was last back at the step a fault interrupted

    # ------------------------------------------------------------------ helpers
    def _rank(self) -> int:
        return self.rng.randrange(self.run.nproc)

    def _kill_rank(self, rank: int, sig: int) -> None:
        os.kill(self.run.worker_pid(rank), sig)

    def _request(self, name: str) -> str:
        """Ask the test plugin for a one-shot fault (it renames the file to `.done` once done): the path."""
        request = os.path.join(self.run.control, name)
        if os.path.exists(request + ".done"):  # the same fault of the same rank, earlier in the run
            os.remove(request + ".done")
        open(request, "w").close()
        return request

    def _back(self, at: int, t0: float) -> tuple[float, int]:
        """After a fault that starts a new attempt: wait until the run is back beyond the last step the old
        attempt logged; (seconds lost: the time since `t0` less the healthy time of the steps gained since
        `at`, steps trained again)."""
        run = self.run

        def back() -> Record | None:
            i = run.attempts_after(t0)
            done = run.records[i - 1].step if i else None
            return next((r for r in run.records[i:] if r.step > done), None) if i else None

        run.wait(lambda: back() is not None, what=f"the run to get past step {at} again")
        i = run.attempts_after(t0)
        record = back()
        lost = run.records[i - 1].step - (run.records[i].step - 1)
        self.back_at = record.seen
        return max(record.seen - t0 - (record.step - at) * self.step_s, 0.0), max(lost, 0)

    def _grep(self, pattern: str, since: int = 0, wait_s: float = 30.0) -> str:
        """The first log line after line `since` that matches, without its prefixes and the job's folder. The
        launcher copies its workers' output into the log from a tailing thread, behind their metrics: a line
        not there yet is waited for (up to `wait_s`)."""
        deadline = time.time() + wait_s
        while True:
            for line in self.run.log().splitlines()[since:]:
                if re.search(pattern, line):
                    line = re.sub(r"^(\[rank\d+\]:)?(\d\d:\d\d:\d\d )?(INFO |WARNING |ERROR )?", "", line).strip()
                    return line.replace(self.run.dump + os.sep, "")
            if time.time() > deadline:
                return "(not found in the log)"
            time.sleep(0.1)

    def _resumed(self, since: int) -> str:
        line = self._grep(r"resumed from", since)
        match = re.search(r"resumed from \S*?(step-\d+)", line)
        return f"resumed from {match.group(1)}" if match else line

    def _corrupt_newest(self, how: str) -> str:
        newest = self.run.complete_checkpoints()[-1]
        path = os.path.join(self.run.dump, "checkpoint", f"step-{newest}")
        shard = self.rng.choice(sorted(glob.glob(os.path.join(path, "__*_0.distcp"))))
        size = os.path.getsize(shard)
        if how == "flip":
            offset = self.rng.randrange(size)
            with open(shard, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ (1 << self.rng.randrange(8))]))
            return f"flipped a bit of byte {offset} of step-{newest}/{os.path.basename(shard)}"
        os.truncate(shard, size // 2)
        return f"cut step-{newest}/{os.path.basename(shard)} from {size} to {size // 2} bytes"

    # ------------------------------------------------------------------ the faults
    def _detect(self, out: Outcome, pattern: str, since: int, t0: float, wait_s: float = 120.0) -> str:
        """Wait for the log line that shows the fault detected; its time (after the injection) into `out`."""
        line = self._grep(pattern, since, wait_s)
        out.detected_s = time.time() - t0 if not line.startswith("(not found") else None
        return line

    def _restarted(self, out: Outcome, at: int, t0: float, lines: int) -> None:
        """A fault that restarts the workers: detected by the launcher, back after the restart."""
        out.detected = self._detect(out, r"worker failure \(rank", lines, t0)
        out.seconds_lost, out.steps_lost = self._back(at, t0)
        out.action = "restart: " + self._resumed(lines)

    def inject(self, kind: str, start: float) -> Outcome:
        run, lines = self.run, len(self.run.log().splitlines())
        at, t0 = run.last, time.time()
        out = Outcome(kind, at, "", injected_s=t0 - start)
        self.back_at = None
        if kind == "kill9":
            rank = self._rank()
            self._kill_rank(rank, signal.SIGKILL)
            out.what = f"kill -9 of rank {rank}"
            self._restarted(out, at, t0, lines)
        elif kind == "node":
            ranks = sorted(self.rng.sample(range(run.nproc), 2))
            for rank in ranks:
                self._kill_rank(rank, signal.SIGKILL)
            out.what = f"kill -9 of ranks {ranks[0]} and {ranks[1]} at once (a lost node)"
            self._restarted(out, at, t0, lines)
        elif kind == "rendezvous":
            rank = self._rank()
            old = run.workers()
            self._kill_rank(rank, signal.SIGKILL)
            run.wait(lambda: run.workers() - old, timeout=120, what="the restarted workers")
            late = sorted(run.workers() - old)
            victim = self.rng.choice(late)
            os.kill(victim, signal.SIGKILL)
            started = sum(os.path.getmtime(os.path.join(run.control, f"pid-{r}")) > t0 for r in range(run.nproc))
            out.what = (f"kill -9 of rank {rank}, then of a restarted worker while the new attempt started ({started} "
                        f"of {run.nproc} ranks had reached their first step)")
            out.detected = self._detect(out, r"worker failure \(rank", lines, t0)
            out.seconds_lost, out.steps_lost = self._back(at, t0)
            failures = [line for line in run.log().splitlines()[lines:] if "worker failure (rank" in line]
            out.action = f"{len(failures)} restarts: " + self._resumed(lines)
        elif kind == "sigstop":
            rank = self._rank()
            self._kill_rank(rank, signal.SIGSTOP)
            out.what = f"SIGSTOP of rank {rank}"
            hangs = set(glob.glob(os.path.join(run.dump, "hangs", "*")))
            declared = lambda: sorted(set(glob.glob(os.path.join(run.dump, "hangs", "*"))) - hangs)  # noqa: E731
            run.wait(lambda: declared() and any(r.seen >= t0 and r.step > at for r in run.records),
                     what="the hang to be declared and the run to go on")
            folder = declared()[0]
            out.detected_s = min(os.path.getmtime(p) for p in glob.glob(os.path.join(folder, "rank-*.txt"))) - t0
            out.detected = (f"hang declared by the monitor {out.detected_s:.1f} s after the stop (hang_timeout_s "
                            f"{HANG_S:g}); every rank's stacks in hangs/{os.path.basename(folder)}")
            if run.attempts_after(t0) is None:  # the monitor continued the stopped rank to dump its stacks
                back = next(r for r in run.records if r.seen >= t0 and r.step > at)
                self.back_at = back.seen
                out.seconds_lost = max(back.seen - t0 - (back.step - at) * self.step_s, 0.0)
                out.action = ("the monitor continued the stopped rank (SIGCONT) to write its stacks; it trained on, "
                              "nothing restarted")
            else:
                out.seconds_lost, out.steps_lost = self._back(at, t0)
                out.action = "exit 4, restart: " + self._resumed(lines)
        elif kind == "preempt":
            os.killpg(run.proc.pid, signal.SIGTERM)
            run.proc.wait(timeout=300)
            run.poll()
            out.what = f"SIGTERM to every process of the launch (exit {run.proc.returncode}), then the same command"
            out.detected = self._detect(out, r"preemption: all ranks stop after step", lines, t0)
            run.launch()
            out.seconds_lost, out.steps_lost = self._back(at, t0)
            out.action = self._grep(r"preemption: checkpoint step-\d+ saved", lines) + "; relaunched: " + self._resumed(
                lines)
        elif kind == "enospc":
            rank = self._rank()
            request = self._request(f"fail-save-{rank}")
            out.what = f"rank {rank}'s next checkpoint write fails (ENOSPC, the file cut short)"
            run.wait(lambda: os.path.exists(request + ".done"), what="the failing save")
            failed = int(open(request + ".done").read())
            out.detected = self._detect(out, rf"checkpoint step-{failed} failed", lines, t0).split("; ")[0]
            run.wait(lambda: any(s > failed for s in run.complete_checkpoints()), what="the next save")
            self.back_at = time.time()
            out.seconds_lost = self._save_cost(failed)
            out.action = f"partial folder removed, training went on; step-{failed + self.interval} saved"
        elif kind in ("flip", "truncate"):
            newest = run.complete_checkpoints()[-1]
            out.what = self._corrupt_newest(kind)
            if kind == "flip":
                rank = self._rank()
                self._kill_rank(rank, signal.SIGKILL)
                out.what += f", then kill -9 of rank {rank}"
            else:
                os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait(timeout=60)
                run.poll()
                out.what += ", then kill -9 of every process of the launch, then the same command"
                run.launch()
            out.detected = self._detect(out, r" is corrupt: ", lines, t0).split("; ")[0]
            out.seconds_lost, out.steps_lost = self._back(at, t0)
            out.action = f"skipped: {self._resumed(lines)} instead of step-{newest} ({at - newest} steps lost otherwise)"
        elif kind == "slow":
            rank = self._rank()
            with open(os.path.join(run.control, f"slow-{rank}"), "w") as f:
                f.write(str(SLOW_S))
            out.detected = self._detect(out, rf"straggler \(steps \d+-\d+\): rank {rank} ", lines, t0)
            run.wait_step(at + SLOW_STEPS)
            os.remove(os.path.join(run.control, f"slow-{rank}"))
            out.what = f"rank {rank} computes {SLOW_S} s more per step for {SLOW_STEPS} steps"
            during = [r for r in run.records if r.seen >= t0]
            self.back_at = during[-1].seen
            out.seconds_lost = max(during[-1].seen - t0 - len(during) * self.step_s, 0.0)
            out.action = "named in the log and metrics; training went on"
        elif kind in ("nonfinite", "sdc"):
            rank = self._rank()
            name = {"nonfinite": "nonfinite-grad", "sdc": "bitflip"}[kind]
            request = self._request(f"{name}-{rank}")
            run.wait(lambda: os.path.exists(request + ".done"), what=f"the {name} request")
            hit = int(open(request + ".done").read())
            if kind == "nonfinite":
                out.what = f"+inf in a gradient of rank {rank} at step {hit}"
                out.detected = self._detect(out, r"guard: step \d+ is bad", lines, t0).split("; ")[0]
                out.seconds_lost, out.steps_lost = self._back(at, t0)
                out.action = self._grep(r"guard: rolled back", lines).split(" (guard.")[0]
            else:
                out.what = f"one bit of a parameter of rank {rank} flipped after the backward of step {hit}"
                out.detected = self._detect(out, r"sdc: after step \d+", lines, t0).split(" (evidence")[0]
                caught = int(re.search(r"after step (\d+)", out.detected).group(1))
                out.corrupted = (hit + 1, caught) if caught > hit else None
                out.seconds_lost, out.steps_lost = self._back(at, t0)
                out.action = self._grep(r"sdc: rolled back", lines)
        if self.back_at is not None:
            out.recovered_s = self.back_at - t0
        return out

    def _save_cost(self, step: int) -> float:
        """The failed save's step took this much longer than a healthy step."""
        seen = {r.step: r.seen for r in self.run.records}
        return max(seen.get(step + 1, 0) - seen.get(step, 0) - self.step_s, 0.0) if step in seen else 0.0


def schedule(kinds: list[str], steps: int, interval: int, rng: random.Random, count: int | None = None
             ) -> list[tuple[int, str]]:
    """(step, fault) pairs: `count` faults (every kind once, the rest drawn from the kinds; default: each kind
    once) in a seeded order, one per slot of the run, at a seeded step of the slot that suits the fault (a
    corruption soon after a checkpoint, so that it hits the newest one; a failing write a few steps before a
    save); a slow rank's slot is longer by the steps it stays slow."""
    order = list(kinds) + [rng.choice(kinds) for _ in range(max((count or 0) - len(kinds), 0))]
    rng.shuffle(order)
    first = 2 * interval + 1  # two checkpoints exist: one to corrupt, one to fall back on
    slot = (steps - first - SLOW_STEPS * order.count("slow") - interval) // len(order)
    if slot < interval + 2:
        raise ValueError(f"{steps} steps are too few for {len(order)} faults at an interval of {interval}")
    plan, start = [], first
    for kind in order:
        step = start + rng.randrange(max(slot - interval, 1))
        want = {"flip": 2, "truncate": 2, "enospc": interval - 3}.get(kind)  # after / before a checkpoint
        if want is not None:
            step += (want - step) % interval
        plan.append((step, kind))
        start += slot + (SLOW_STEPS if kind == "slow" else 0)
    return plan


def losses_by_step(records: list[Record]) -> dict[int, list[float | None]]:
    seen: dict[int, list[float | None]] = {}
    for r in records:
        seen.setdefault(r.step, []).append(r.loss)
    return seen


def reference(folder: str, nproc: int, steps: int, interval: int) -> tuple[dict[int, float], float]:
    run = Run(os.path.join(folder, "reference"), nproc,
              job(os.path.join(folder, "reference", "job"), steps, interval, nproc))
    os.makedirs(run.folder, exist_ok=True)
    t0 = time.time()
    try:
        run.launch()
        run.finish()
    finally:
        run.stop()
    return {r.step: r.loss for r in run.records}, time.time() - t0


def chaos(folder: str, nproc: int, steps: int, interval: int, seed: int, kinds: list[str], out=print,
          count: int | None = None, warmup: bool = True) -> tuple[bool, list[Outcome]]:
    """The whole benchmark: (whether the chaos run ended bitwise equal to the reference and logged no step with
    two different losses but where a silently corrupted replica trained, what each fault did); the report and
    its timeline picture are written into `folder`."""
    shutil.rmtree(folder, ignore_errors=True)
    if warmup:  # the first launch on a machine reads torch and the job's modules from disk: an untimed short
        # one first, so that the reference does not carry that cost and the comparison with it stays fair
        reference(os.path.join(folder, "warmup"), nproc, 2, interval)
    ref, ref_s = reference(folder, nproc, steps, interval)
    out(f"reference: {steps} steps of {nproc} processes in {ref_s:.1f} s")
    rng = random.Random(seed)
    plan = schedule(kinds, steps, interval, rng, count)
    out("schedule (seed %d): %s" % (seed, ", ".join(f"{k} at step {s}" for s, k in plan)))
    run = Run(os.path.join(folder, "chaos"), nproc, job(os.path.join(folder, "chaos", "job"), steps, interval, nproc))
    os.makedirs(run.folder, exist_ok=True)
    driver = Chaos(run, interval, rng)
    t0 = time.time()
    outcomes = []
    try:
        run.launch()
        for step, kind in plan:
            run.wait_step(step)
            if not driver.step_s:
                gaps = [b.seen - a.seen for a, b in zip(run.records, run.records[1:]) if b.step == a.step + 1]
                driver.step_s = statistics.median(gaps[len(gaps) // 4:]) if gaps else 0.0
            outcomes.append(driver.inject(kind, t0))
        run.finish()
    finally:
        run.stop()
    total = time.time() - t0
    logged = losses_by_step(run.records)
    final = {s: v[-1] for s, v in logged.items()}
    silent = {s for o in outcomes if o.corrupted for s in range(o.corrupted[0], o.corrupted[1] + 1)}
    twice = {s: v for s, v in logged.items() if len(set(v)) > 1 and s not in silent}
    equal = final == ref
    weights = same_tensors(final_tensors(os.path.join(folder, "reference", "job"), steps),
                           final_tensors(run.dump, steps))
    summary = chaos_report.Summary(seed, nproc, steps, interval, len(outcomes), run.launches, total, ref_s,
                                   driver.step_s, sum(len(v) for v in logged.values()) - len(logged), equal, weights,
                                   sorted(twice), sorted(silent))
    for line in chaos_report.text(summary, outcomes):
        out(line)
    if not equal:
        out("first differences: " + ", ".join(f"step {s}: {ref.get(s)} vs {final.get(s)}"
                                              for s in sorted(set(ref) | set(final)) if ref.get(s) != final.get(s))[:600])
    chaos_report.write(folder, summary, outcomes, run.records, t0)
    out(f"report: {os.path.join(folder, 'report.json')}, timeline: {os.path.join(folder, 'timeline.svg')}")
    return equal and weights and not twice, outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default="all", help=f"comma-separated among {', '.join(FAULTS)}, or all")
    ap.add_argument("--count", type=int, default=20, help="faults in all (every kind once, the rest drawn)")
    ap.add_argument("--folder", default="/tmp/torchtrain-chaos")
    args = ap.parse_args(argv)
    kinds = list(FAULTS) if args.faults == "all" else args.faults.split(",")
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        ap.error(f"unknown faults {sorted(unknown)}; choose among {', '.join(FAULTS)}")
    if "sdc" in kinds and args.nproc % 2:
        ap.error("sdc needs two replicas to compare: an even --nproc")
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.nproc} processes")
    ok, _ = chaos(args.folder, args.nproc, args.steps, args.interval, args.seed, kinds, count=args.count)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
