"""DualPipeV's overlapped forward/backward pairs, run concurrently (`parallelism.expert_parallel_overlap_f_b`).

torch's `ScheduleDualPipeV` emits `OVERLAP_F_B` actions -- the forward of micro-batch i on one of the
rank's two stages and the full backward of micro-batch j on the other -- and runs them one after the
other unless a function is registered for them. `register_overlap_f_b` registers one that runs the
backward in a worker thread while this thread runs the forward: when one waits for its expert
all-to-all (the wait releases the GIL), the other computes.

Why it stays correct and hang-free:

* collectives are matched by issue order per process group on every rank. The rank's EP peers run the
  same action list (they hold the same pipeline stages), so each thread issues its collectives in the
  same order on every peer; the two threads use different groups: the all-to-alls issued inside
  autograd's backward (gradients, recomputed forwards) go over a second EP group
  (`ExpertLink.current_group`, `token_dispatch.backward_ep_group`), the forward's over the EP group;
* no other collective runs inside the pair: everything that touches the schedule's shared state or a
  process group other than EP -- waiting for the pipeline receives and FSDP's unshard, reading the
  loss, counting the backward, handing a result to the neighbouring stage on this rank -- happens in
  this thread before the worker starts or after it has joined. FSDP under a pipeline neither gathers
  nor reduces inside a micro-batch's forward or backward (torch's stage defers the reduce-scatter to
  the REDUCE_GRAD action; parameters stay unsharded between UNSHARD and RESHARD). Tensor and context
  parallelism, whose collectives would run in both threads on one group, are refused by the config,
  and so is data parallelism by replication (its gradient all-reduce runs inside backward);
* the two computations touch disjoint state: different stage modules, different micro-batches.

The numbers are those of the plain schedule: every operation is the same, only the two threads'
interleaving in time differs.
"""

from __future__ import annotations

import threading

from torchtrain.config.fields import ConfigError


def register_overlap_f_b(schedule) -> None:
    """Run `schedule`'s OVERLAP_F_B actions concurrently (see the module doc). `schedule`: DualPipeV."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _PipelineScheduleRuntime

    if not isinstance(schedule, _PipelineScheduleRuntime):
        raise ConfigError("[parallelism.expert_parallel_overlap_f_b] needs the DualPipeV schedule")
    for stage in schedule._stages:
        if not isinstance(stage.submod, FSDPModule) and "replicate" in (_get_registry(stage.submod) or {}):
            raise ConfigError("[parallelism.expert_parallel_overlap_f_b] does not work with data parallelism by "
                              "replication (its gradient all-reduce would run inside the concurrent backward); "
                              "use FSDP/HSDP or set it to false")
    schedule.overlapped_pairs = 0  # forward/backward pairs run concurrently so far (logged by the runner)
    schedule.register_custom_function(OVERLAP_F_B, _overlap_f_b)


def _overlap_f_b(action, ctx) -> None:
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    sched = ctx.schedule_ref
    fwd, bwd = action.sub_actions
    stages = {s.stage_index: s for s in sched._stages}
    f_stage, b_stage = stages[fwd.stage_index], stages[bwd.stage_index]
    f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
    # ---- before: everything that reads or changes the schedule's shared state, in this thread
    sched._assert_unsharded(f_stage)
    sched._assert_unsharded(b_stage)
    if not f_stage.is_first and fwd.stage_index - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
    if not b_stage.is_last and bwd.stage_index + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
    loss = sched._maybe_get_loss(b_stage, b_mb)
    sched.backward_counter[bwd.stage_index] += 1
    last = sched.backward_counter[bwd.stage_index] == sched._n_microbatches

    failure: list[BaseException] = []

    def backward() -> None:
        try:
            b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)
        except BaseException as e:  # re-raised in the schedule's thread
            failure.append(e)

    worker = threading.Thread(target=backward, name=f"overlap-backward-{bwd.stage_index}-{b_mb}", daemon=True)
    worker.start()
    # ---- during: the forward here (a failure propagates at once; the daemon worker dies with the job)
    output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb])
    worker.join()
    if failure:
        raise failure[0]
    sched.overlapped_pairs += 1
    # ---- after: the loss and the hand-overs to the neighbouring stage on this rank
    sched._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
    if fwd.stage_index + 1 in stages:
        stages[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)
    if bwd.stage_index - 1 in stages:
        stages[bwd.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb), b_mb)
