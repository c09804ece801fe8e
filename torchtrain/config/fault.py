"""Config section for surviving failures: [fault] (docs/resilience.md).

* Hang detection: every rank reports its progress (the step and the phase it is in) to a monitor
  thread that talks through torchrun's TCPStore, not the training process group. A rank without
  progress for `hang_timeout_s` (`slow_phase_timeout_s` in start-up, checkpoint, validation and
  shutdown) makes every rank dump its Python stacks to `{dump_folder}/hangs/<time>/` and exit with
  the hang exit status (4) instead of waiting for the collective timeout.
* Automatic restart: `max_restarts` is torchrun's `--max-restarts` (the launcher reads it), or with
  `restart_window_s` the restarts allowed within that window; a restarted job resumes from the newest complete
  checkpoint.
* Straggler detection: every `straggler_freq` steps the ranks' own compute times are compared.
* Replica-group fault tolerance (`replica_ft`): each data-parallel replica group is its own job,
  joined to the others through torchft, so that losing one group does not stop the rest.
* Silent data corruption (`sdc_*`): the data-parallel replicas' parameters (and optimizer state)
  are hashed and compared on a schedule and before every checkpoint save, or without replicas a
  forward is run again and compared (components/fault/replica_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from torchtrain.config.fields import ConfigError, Ge, Gt

DEFAULT_HANG_TIMEOUT_S = 60.0


@dataclass
class Fault:
    hang_timeout_s: Annotated[float, Gt(0)] | None = DEFAULT_HANG_TIMEOUT_S
    """A rank that makes no progress (enters no new phase of a step: data, forward_backward,
    optimizer, ...) for this many seconds is hung: every rank writes its Python stacks (and on CUDA
    the NCCL flight recorder) to `{dump_folder}/hangs/<time>/`, the log names the stuck ranks and
    where they are, and the job ends with exit status 4 (restarted when `max_restarts` allows).
    Must be shorter than comm.train_timeout_seconds, or the collective timeout would end the job
    first, without evidence; left at its default, it becomes 0.8 x a comm.train_timeout_seconds of
    60 s or less. Unset (`none`): no monitor."""

    slow_phase_timeout_s: Annotated[float, Gt(0)] = 240.0
    """The hang timeout of phases that are legitimately long: start-up until the first step is done
    (model build, checkpoint load, compilation), checkpoint saves and restores, validation, waiting
    for the replica groups' quorum (replica_ft) and the final shutdown. Must be shorter than
    comm.init_timeout_seconds (their collective timeout)."""

    max_restarts: Annotated[int, Ge(0)] = 0
    """How often torchrun restarts the workers after a failure (a crashed or killed rank, a detected
    hang); the restarted job resumes from the newest complete checkpoint (checkpoint.enable). The
    launcher (run_train.sh, the SLURM script) passes it as `torchrun --max-restarts`. A config error
    (exit 2) or a guard abort (exit 3) is final and never restarted. Restarts are logged and counted
    in the metrics (`restarts`)."""

    restart_window_s: Annotated[float, Ge(0)] = 0.0
    """0: `max_restarts` counts every restart of the job. > 0: it counts the restarts within the last
    `restart_window_s` seconds only -- a burst of failures (a fault that comes back at every restart) ends the
    job after `max_restarts` quick restarts, while failures spread over a long run never use the budget up
    (systemd's StartLimitBurst within StartLimitIntervalSec)."""

    straggler_freq: Annotated[int, Ge(0)] = 100
    """Every this many steps, compare the ranks' own compute time (data, forward_backward,
    optimizer: thread CPU time on CPU, compute-kernel time on CUDA; time spent waiting in
    collectives excluded) over the last window of steps; a rank slower than the median by more than
    `straggler_threshold` is named (rank, host, phase, how much slower) in the log and the metrics.
    0: off."""

    straggler_threshold: Annotated[float, Gt(0)] = 0.2
    """Relative slowdown that makes a straggler: a rank's compute time per step exceeds the median
    rank's by more than this fraction (0.2: 20% slower)."""

    replica_ft: bool = False
    """Replica-group fault tolerance: the `parallelism.data_parallel_replicate_degree` replica groups
    run as separate jobs (one run_train.sh / torchrun per group, each with the rest of the layout:
    FSDP over its own ranks), joined through torchft (`pip install "torchtrain[ft]"`, its
    `torchft_lighthouse` running somewhere every group reaches). A lost group does not stop the
    others: they continue on their own share of the global batch, and a restarted group rejoins by
    receiving the live training state from a surviving group (docs/resilience.md)."""

    replica_id: Annotated[int, Ge(0)] | None = None
    """With replica_ft: this job's replica group, 0 .. data_parallel_replicate_degree - 1 (every
    group is launched with its own id)."""

    lighthouse: str | None = None
    """With replica_ft: the address of torchft's lighthouse, e.g. `http://host:29510`. Unset:
    $TORCHFT_LIGHTHOUSE."""

    min_replica_groups: Annotated[int, Ge(1)] = 1
    """With replica_ft: a step is applied only when at least this many replica groups took part in
    it."""

    sdc_check_freq: Annotated[int, Ge(0)] = 0
    """Silent data corruption check: every this many steps, and before every checkpoint save, each
    data-parallel replica (DDP and ZeRO-1 ranks, HSDP replica groups) hashes the parameters it holds
    (one pass, exact integer hashes of the bits) and the hashes are compared across the replicas,
    which must hold bitwise-equal values; a difference names the step, the ranks and the tensor, and
    its evidence goes to `{dump_folder}/sdc/step-N.json`. A layout without replicas (pure FSDP, TP,
    CP) runs the step's first micro-batch's forward again instead and compares the logits bitwise (not
    under PP, nor for MoE models: said once, off). Cost: reading the replica's state a few times per
    check plus one all-gather of 16 bytes per tensor, or one micro-batch's forward (docs/resilience.md).
    0: off."""

    sdc_policy: Literal["rollback", "abort", "warn"] = "rollback"
    """What a detected difference does: `rollback` restores the newest checkpoint (written after a
    clean check, so it predates the corruption) with its data position and trains the lost steps
    again; `abort` stops the job (exit status 6, not restarted: the hardware needs attention first);
    `warn` logs it and goes on."""

    sdc_check_optimizer: bool = True
    """Compare the optimizer state too (not under ZeRO-1, whose ranks hold different shards of it)."""

    sdc_exclude_file: str | None = None
    """A file the hosts of the ranks a check names are appended to (one per line, each once), for the
    scheduler to leave out when it restarts the job (e.g. SLURM's `--exclude=$(paste -sd, FILE)`); the launcher
    does not start the job on a host the file lists (exit 6)."""

    replica_timeout_s: Annotated[float, Gt(0)] = 30.0
    """With replica_ft: the timeout of collectives across replica groups and of forming a quorum; a
    group that does not answer within it is dropped from the step. Also how long a starting job waits
    for every replica group before its first step. Must be shorter than hang_timeout_s (a step that
    waits for a lost group is not a hang)."""


def check_fault(job) -> None:
    """[fault] and the debug fault injections against the other sections (JobConfig.validate calls it)."""
    fault, comm, par, debug = job.fault, job.comm, job.parallelism, job.debug
    if fault.hang_timeout_s is not None:
        if fault.hang_timeout_s == DEFAULT_HANG_TIMEOUT_S and fault.hang_timeout_s >= comm.train_timeout_seconds:
            fault.hang_timeout_s = 0.8 * comm.train_timeout_seconds  # e.g. torchtitan's fault-tolerance job: 15 s
        if fault.hang_timeout_s >= comm.train_timeout_seconds:
            raise ConfigError(
                f"[fault.hang_timeout_s] {fault.hang_timeout_s:g} must be shorter than comm.train_timeout_seconds "
                f"({comm.train_timeout_seconds}): the collective timeout would end a hung job first, without the "
                f"stack dumps; lower fault.hang_timeout_s or raise comm.train_timeout_seconds")
        if fault.slow_phase_timeout_s >= comm.init_timeout_seconds:
            raise ConfigError(
                f"[fault.slow_phase_timeout_s] {fault.slow_phase_timeout_s:g} must be shorter than "
                f"comm.init_timeout_seconds ({comm.init_timeout_seconds}), the collective timeout of start-up and "
                f"checkpoints; lower it or raise comm.init_timeout_seconds")
    if fault.restart_window_s and not fault.max_restarts:
        raise ConfigError(f"[fault.restart_window_s] {fault.restart_window_s:g} bounds the restarts within a window, "
                          f"but fault.max_restarts is 0 (no restarts at all); set fault.max_restarts >= 1, the "
                          f"restarts allowed within the window")
    if fault.sdc_check_freq and fault.sdc_policy == "rollback" and not job.checkpoint.enable:
        raise ConfigError("[fault.sdc_policy] \"rollback\" restores the newest checkpoint, but checkpoint.enable is "
                          "false; enable checkpoints, or set fault.sdc_policy to \"abort\" or \"warn\"")
    if debug.inject_bitflip_step is not None and not fault.sdc_check_freq:
        raise ConfigError("[debug.inject_bitflip_step] is a test of the silent data corruption check: set "
                          "fault.sdc_check_freq too")
    if debug.inject_delay_s > 0 and not debug.inject_delay_ranks:
        raise ConfigError("[debug.inject_delay_s] needs debug.inject_delay_ranks: the global ranks to slow down")
    if not fault.replica_ft:
        return
    replicas = par.data_parallel_replicate_degree
    if replicas < 2:
        raise ConfigError(f"[fault.replica_ft] needs parallelism.data_parallel_replicate_degree >= 2 (the number of "
                          f"replica groups), got {replicas} (torchtitan's spelling: --fault_tolerance.group_size)")
    if fault.replica_id is None or fault.replica_id >= replicas:
        raise ConfigError(f"[fault.replica_id] must name this job's replica group, 0 .. {replicas - 1} "
                          f"(parallelism.data_parallel_replicate_degree = {replicas}), got {fault.replica_id}; "
                          f"launch every group with its own --fault.replica_id (or torchtitan's --fault_tolerance.replica_id)")
    if fault.hang_timeout_s is not None and fault.replica_timeout_s >= fault.hang_timeout_s:
        raise ConfigError(f"[fault.replica_timeout_s] {fault.replica_timeout_s:g} must be shorter than "
                          f"fault.hang_timeout_s ({fault.hang_timeout_s:g}): a step waiting that long for a lost replica "
                          f"group would be taken for a hang")
    if fault.min_replica_groups > replicas:
        raise ConfigError(f"[fault.min_replica_groups] {fault.min_replica_groups} exceeds the number of replica "
                          f"groups ({replicas})")
