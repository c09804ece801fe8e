"""Chaos: one deterministic training job under a seeded schedule of faults injected from outside while it
runs; it must end with the losses of the uninterrupted run, bitwise.

    python benchmarks/chaos.py [--nproc 4] [--steps 300] [--interval 10] [--seed 0] [--faults all]
                               [--folder /tmp/torchtrain-chaos]

The job (FSDP over `--nproc` CPU processes under the launcher, the tiny model, deterministic kernels, a
checkpoint every `--interval` steps, keep_latest_k 3, fault.max_restarts 10, hang_timeout_s 4, a
straggler comparison every 10 steps, guard.policy rollback with rollback_replay) runs once undisturbed
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

The slow rank, the gradient and the failing write are requested through a control folder that the
test plugin (tests/plugins/fault_injection.py, loaded with job.custom_imports) reads; the job and its
launches are benchmarks/chaos_job.py. For each fault the
benchmark prints how it was detected (the log line), the action taken, and what it cost: the seconds
from the injection until the run is back at the step it had reached, less one healthy step; the steps
trained again. Then it checks that the final losses equal the reference bitwise (each step's latest
logged loss) and that no step's loss was ever logged with two different values; exit status 1 if not.
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
from dataclasses import dataclass

from chaos_job import HANG_S, Record, Run, job

FAULTS = ("kill9", "sigstop", "preempt", "enospc", "flip", "truncate", "slow", "nonfinite")
SLOW_S, SLOW_STEPS = 0.3, 25


@dataclass
class Outcome:
    kind: str
    step: int  # the last step logged when the fault was injected
    what: str
    detected: str = "?"
    action: str = "?"
    seconds_lost: float = 0.0
    steps_lost: int = 0


class Chaos:
    def __init__(self, run: Run, interval: int, rng: random.Random):
        self.run, self.interval, self.rng = run, interval, rng
        self.step_s = 0.0  # a healthy step's wall time, measured before the first fault

    # ------------------------------------------------------------------ helpers
    def _rank(self) -> int:
        return self.rng.randrange(self.run.nproc)

    def _kill_rank(self, rank: int, sig: int) -> None:
        os.kill(self.run.worker_pid(rank), sig)

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
    def inject(self, kind: str) -> Outcome:
        run, lines = self.run, len(self.run.log().splitlines())
        at, t0 = run.last, time.time()
        out = Outcome(kind, at, "")
        if kind == "kill9":
            rank = self._rank()
            self._kill_rank(rank, signal.SIGKILL)
            out.what = f"kill -9 of rank {rank}"
            out.seconds_lost, out.steps_lost = self._back(at, t0)
            out.detected = self._grep(r"worker failure \(rank", lines)
            out.action = "restart: " + self._resumed(lines)
        elif kind == "sigstop":
            rank = self._rank()
            self._kill_rank(rank, signal.SIGSTOP)
            out.what = f"SIGSTOP of rank {rank}"
            hangs = set(glob.glob(os.path.join(run.dump, "hangs", "*")))
            declared = lambda: sorted(set(glob.glob(os.path.join(run.dump, "hangs", "*"))) - hangs)  # noqa: E731
            run.wait(lambda: declared() and any(r.seen >= t0 and r.step > at for r in run.records),
                     what="the hang to be declared and the run to go on")
            folder = declared()[0]
            after = min(os.path.getmtime(p) for p in glob.glob(os.path.join(folder, "rank-*.txt"))) - t0
            out.detected = (f"hang declared by the monitor {after:.1f} s after the stop (hang_timeout_s {HANG_S:g}); "
                            f"every rank's stacks in hangs/{os.path.basename(folder)}")
            if run.attempts_after(t0) is None:  # the monitor continued the stopped rank to dump its stacks
                back = next(r for r in run.records if r.seen >= t0 and r.step > at)
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
            run.launch()
            out.seconds_lost, out.steps_lost = self._back(at, t0)
            out.detected = self._grep(r"preemption: all ranks stop after step", lines)
            out.action = self._grep(r"preemption: checkpoint step-\d+ saved", lines) + "; relaunched: " + self._resumed(
                lines)
        elif kind == "enospc":
            rank = self._rank()
            request = os.path.join(run.control, f"fail-save-{rank}")
            open(request, "w").close()
            out.what = f"rank {rank}'s next checkpoint write fails (ENOSPC, the file cut short)"
            run.wait(lambda: os.path.exists(request + ".done"), what="the failing save")
            failed = int(open(request + ".done").read())
            run.wait(lambda: any(s > failed for s in run.complete_checkpoints()), what="the next save")
            out.seconds_lost = self._save_cost(failed)
            out.detected = self._grep(rf"checkpoint step-{failed} failed", lines).split("; ")[0]
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
            out.seconds_lost, out.steps_lost = self._back(at, t0)
            out.detected = self._grep(r" is corrupt: ", lines).split("; ")[0]
            out.action = f"skipped: {self._resumed(lines)} instead of step-{newest} ({at - newest} steps lost otherwise)"
        elif kind == "slow":
            rank = self._rank()
            with open(os.path.join(run.control, f"slow-{rank}"), "w") as f:
                f.write(str(SLOW_S))
            run.wait_step(at + SLOW_STEPS)
            os.remove(os.path.join(run.control, f"slow-{rank}"))
            out.what = f"rank {rank} computes {SLOW_S} s more per step for {SLOW_STEPS} steps"
            during = [r for r in run.records if r.seen >= t0]
            out.seconds_lost = max(during[-1].seen - t0 - len(during) * self.step_s, 0.0)
            out.detected = self._grep(rf"straggler \(steps \d+-\d+\): rank {rank} ", lines)
            out.action = "named in the log and metrics; training went on"
        elif kind == "nonfinite":
            rank = self._rank()
            open(os.path.join(run.control, f"nonfinite-grad-{rank}"), "w").close()
            run.wait(lambda: os.path.exists(os.path.join(run.control, f"nonfinite-grad-{rank}.done")), what="the NaN")
            hit = int(open(os.path.join(run.control, f"nonfinite-grad-{rank}.done")).read())
            out.what = f"+inf in a gradient of rank {rank} at step {hit}"
            out.seconds_lost, out.steps_lost = self._back(at, t0)
            out.detected = self._grep(r"guard: step \d+ is bad", lines).split("; ")[0]
            out.action = self._grep(r"guard: rolled back", lines).split(" (guard.")[0]
        return out

    def _save_cost(self, step: int) -> float:
        """The failed save's step took this much longer than a healthy step."""
        seen = {r.step: r.seen for r in self.run.records}
        return max(seen.get(step + 1, 0) - seen.get(step, 0) - self.step_s, 0.0) if step in seen else 0.0


def schedule(kinds: list[str], steps: int, interval: int, rng: random.Random) -> list[tuple[int, str]]:
    """(step, fault) pairs: the kinds in a seeded order, one per slot of the run, at a seeded step of the slot
    that suits the fault (a corruption soon after a checkpoint, so that it hits the newest one; a failing
    write a few steps before a save)."""
    order = list(kinds)
    rng.shuffle(order)
    first = 2 * interval + 1  # two checkpoints exist: one to corrupt, one to fall back on
    slot = (steps - first - (SLOW_STEPS if "slow" in order else 0) - interval) // len(order)
    if slot < interval + 2:
        raise ValueError(f"{steps} steps are too few for {len(order)} faults at an interval of {interval}")
    plan = []
    for i, kind in enumerate(order):
        step = first + i * slot + rng.randrange(max(slot - interval, 1))
        want = {"flip": 2, "truncate": 2, "enospc": interval - 3}.get(kind)  # after / before a checkpoint
        if want is not None:
            step += (want - step) % interval
        plan.append((step, kind))
    return plan


def losses_by_step(records: list[Record]) -> dict[int, list[float | None]]:
    seen: dict[int, list[float | None]] = {}
    for r in records:
        seen.setdefault(r.step, []).append(r.loss)
    return seen


def reference(folder: str, nproc: int, steps: int, interval: int) -> tuple[dict[int, float], float]:
    run = Run(os.path.join(folder, "reference"), nproc, job(os.path.join(folder, "reference", "job"), steps, interval))
    os.makedirs(run.folder, exist_ok=True)
    t0 = time.time()
    try:
        run.launch()
        run.finish()
    finally:
        run.stop()
    return {r.step: r.loss for r in run.records}, time.time() - t0


def chaos(folder: str, nproc: int, steps: int, interval: int, seed: int, kinds: list[str], out=print
          ) -> tuple[bool, list[Outcome]]:
    """The whole benchmark: (whether the chaos run ended bitwise equal to the reference and logged no step with
    two different losses, what each fault did)."""
    shutil.rmtree(folder, ignore_errors=True)
    ref, ref_s = reference(folder, nproc, steps, interval)
    out(f"reference: {steps} steps of {nproc} processes in {ref_s:.1f} s")
    rng = random.Random(seed)
    plan = schedule(kinds, steps, interval, rng)
    out("schedule (seed %d): %s" % (seed, ", ".join(f"{k} at step {s}" for s, k in plan)))
    run = Run(os.path.join(folder, "chaos"), nproc, job(os.path.join(folder, "chaos", "job"), steps, interval))
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
            outcomes.append(driver.inject(kind))
        run.finish()
    finally:
        run.stop()
    total = time.time() - t0
    header = ("fault", "at step", "what", "detected", "action", "s lost", "steps lost")
    out("\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for o in outcomes:
        out(f"| {o.kind} | {o.step} | {o.what} | {o.detected} | {o.action} | {o.seconds_lost:.1f} | {o.steps_lost} |")
    logged = losses_by_step(run.records)
    final = {s: v[-1] for s, v in logged.items()}
    twice = {s: v for s, v in logged.items() if len(set(v)) > 1}
    equal = final == ref
    out(f"\nchaos run: {len(outcomes)} faults, {run.launches} launches, {total:.1f} s ({total - ref_s:+.1f} s against "
        f"the reference); {sum(len(v) for v in logged.values()) - len(logged)} steps logged again")
    out(f"final losses equal to the reference, bitwise: {equal} ({len(final)} steps); a step logged with different "
        f"losses: {sorted(twice) or 'none'}")
    if not equal:
        out("first differences: " + ", ".join(f"step {s}: {ref.get(s)} vs {final.get(s)}"
                                              for s in sorted(set(ref) | set(final)) if ref.get(s) != final.get(s))[:600])
    return equal and not twice, outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default="all", help=f"comma-separated among {', '.join(FAULTS)}, or all")
    ap.add_argument("--folder", default="/tmp/torchtrain-chaos")
    args = ap.parse_args(argv)
    kinds = list(FAULTS) if args.faults == "all" else args.faults.split(",")
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        ap.error(f"unknown faults {sorted(unknown)}; choose among {', '.join(FAULTS)}")
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.nproc} processes")
    ok, _ = chaos(args.folder, args.nproc, args.steps, args.interval, args.seed, kinds)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
