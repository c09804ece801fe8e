"""The Trainer: builds a run from a parsed job and runs its loop (the command is `torchtrain/train.py`).

Reading order: `Trainer.__init__` checks everything that can be wrong with it and resolves the Layout (`preflight`)
before any process group starts, then builds mesh -> model parts (meta -> parallelised -> weights) -> the train step
(optimizer, schedule, loss, precision, pipeline) -> data -> metrics -> checkpoints; `Trainer.train` runs the loop
and `TrainStep` (trainer/step.py) is one step.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from torchtrain.components.checkpoint import CheckpointManager, ModelInfo
from torchtrain.components.checkpoint.state import training_states
from torchtrain.components.evaluation.in_loop import InLoopEvaluation
from torchtrain.components.evaluation.tasks import load_tasks
from torchtrain.components.evaluation.validation import build_validation_sources
from torchtrain.components.fault import FaultRuntime
from torchtrain.components.fault.replica_check import CorruptionAbort, Mismatch, ReplicaCheck
from torchtrain.components.hardware import MemoryMonitor, peak_tflops
from torchtrain.components.observability.compile_monitor import CompileMonitor
from torchtrain.components.observability.metrics import MetricsLogger, ThroughputMeter
from torchtrain.components.observability.phases import PhaseTimer
from torchtrain.components.observability.profiling import Profiler
from torchtrain.components.observability.tensor_memory import StepMemoryMeter
from torchtrain.components.offload.runtime import OffloadRuntime, ResidentModelState
from torchtrain.components.optim.lr_scheduler import LRSchedulersContainer
from torchtrain.components.optim.optimizer import OptimizersContainer
from torchtrain.config import JobConfig, to_dict, to_toml
from torchtrain.data.build import build_dataloader, training_sources
from torchtrain.data.sources import CHAT, PROMPTS
from torchtrain.distributed.cluster import check_cluster
from torchtrain.distributed.parallelize import build_model_parts
from torchtrain.distributed.replica_ft import ReplicaGroups, run_folder, state_digest
from torchtrain.distributed.roles import generator_ranks, job_roles
from torchtrain.distributed.utils import (
    env_rank_world,
    init_distributed,
    resolve_device,
    set_determinism,
    set_train_timeout,
)
from torchtrain.models.converters.lora import lora_adapter_class
from torchtrain.posttrain.objectives import build_objective, supplies_data
from torchtrain.trainer.gc_control import GarbageCollection
from torchtrain.trainer.guard import GuardAbort, TrainingGuard
from torchtrain.trainer.hooks import OperationsHooks
from torchtrain.trainer.preflight import check_job
from torchtrain.trainer.state import TrainState
from torchtrain.trainer.step import StepResult
from torchtrain.trainer.step_factory import build_train_step
from torchtrain.trainer.step_record import StepValues, defers_log, step_clock
from torchtrain.utils import extensions
from torchtrain.utils.cpu_threads import apply_threads
from torchtrain.utils.logging import is_log_rank, logger


class Trainer:
    def __init__(self, job_config: JobConfig):
        self.job_config = cfg = job_config
        self.rank, _, world_size = env_rank_world()

        # 1. Everything checkable without a process group, so a bad job fails fast on every rank.
        self.device = device = resolve_device(cfg.training.device)
        job = check_job(cfg, world_size, device.type)  # launch_check ran the same before torchrun
        self.layout, self.tokenizer = layout, tokenizer = job.layout, job.tokenizer
        spec, args = job.model_spec, job.model_args
        dims, self.batch = layout.dims, layout.batch
        if cfg.lr_scheduler.warmup_steps > cfg.training.steps and is_log_rank():  # the same on every rank: say it once
            logger.warning("lr_scheduler.warmup_steps (%d) > training.steps (%d): the peak lr is never reached",
                           cfg.lr_scheduler.warmup_steps, cfg.training.steps)
        # Data: prepared token folders, checked against the tokenizer (document datasets are prepared into
        # the cache on first use, by one process while the others wait).
        sources = training_sources(cfg.training, cfg.model.hf_assets_path, tokenizer, cfg.debug.seed, job.image_spec) \
            if not supplies_data(cfg) else []  # an objective with data of its own (sampled rollouts) reads none
        held_out = build_validation_sources(cfg.validation, cfg.training, cfg.model.hf_assets_path, tokenizer,
                                            cfg.debug.seed, job.image_spec)  # [] unless enabled
        eval_tasks = load_tasks(cfg.eval)  # [] unless enabled

        # 2. Process group, mesh, RNG; from here on the [fault] monitor watches every phase (docs/resilience.md).
        init_distributed(cfg.comm, device, job_roles(cfg).group())
        self.run_folder = run_folder(cfg.job.dump_folder, cfg.fault)  # a replica group's own folder under replica_ft
        self.state = TrainState(device, self.batch.global_batch_size, cfg.training.global_batch_size != -1)
        self.fault = FaultRuntime(cfg.fault, cfg.debug, self.run_folder, self.state, device, self.rank,
                                  dims.world_size, cfg.profiling.enable_profiling)
        self.replicas: ReplicaGroups | None = None  # joined last, right before training (fault.replica_ft)
        self._replay = False  # the guard's latest rollback restored the data position (guard.rollback_replay)
        dims.build_mesh(device.type)
        set_determinism(cfg.debug.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
        self._write_config()
        checkpoint_folder = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
        check_cluster(checkpoint_folder if cfg.checkpoint.enable else None)  # a multi-node folder must be shared
        active = args.num_active_params()
        model_name = f"{cfg.model.name} ({args.describe()})" if args.describe() else \
            f"{cfg.model.name}/{cfg.model.flavor}"
        apart = f" (+ {generator_ranks(cfg)} sampling apart)" if generator_ranks(cfg) else ""
        logger.info("%s | %d processes%s: %s | device %s | model %s, %.2fM parameters%s", cfg.job.description,
                    dims.world_size, apart, layout.describe(), device, model_name, args.num_params() / 1e6,
                    f" ({active / 1e6:.2f}M active per token)" if active != args.num_params() else "")
        if device.type == "cpu":
            logger.info("%s", apply_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        for level, text in cfg.job.notices:  # torchtitan keys adapted or dropped (config/torchtitan.py)
            (logger.warning if level == "warning" else logger.info)("%s", text)

        # 3. Model: built on the meta device (no memory), cut into this rank's pipeline stages (or kept whole),
        #    parallelised as the layout says, then materialised and initialised shard by shard with values that do
        #    not depend on the layout. A model with its own weights (a transformers folder) loads every base weight
        #    at start-up (the folder's, or a checkpoint's): its initialisation draws only what is not loaded.
        hf_weights = spec.hf_weights(args) if spec.hf_weights else None
        loaded = bool(hf_weights) and "model" not in cfg.checkpoint.exclude_from_loading
        self.model_parts = build_model_parts(spec, args, layout, device, cfg.debug.seed, loaded)
        if layout.lora is not None:  # numel of a sharded parameter is its global size
            trainable = sum(p.numel() for part in self.model_parts for p in part.parameters() if p.requires_grad)
            logger.info("LoRA: rank-%d adapters, %.3fM trainable parameters (%.2f%% of the model); the rest frozen",
                        layout.lora.rank, trainable / 1e6, 100 * trainable / args.num_params())

        # 4. The train step (optimizer, schedule, loss, precision, pipeline schedule), data, metrics.
        self.optimizers = OptimizersContainer.for_layout(self.model_parts, cfg.optimizer, layout)
        self.lr_schedulers = LRSchedulersContainer(self.optimizers, cfg.lr_scheduler, cfg.training.steps)
        state_device = device if layout.state_device_type == device.type else torch.device("cpu")
        self.offload = OffloadRuntime(cfg.offload, self.model_parts, self.optimizers, state_device, self.rank,
                                      layout.swaps_params) if cfg.offload.enabled else None  # docs/offload.md
        # what the run optimises (trainer/objective.py): plain training, or a post-training objective with its own
        # loss, and maybe its own data (a loader that samples the model's completions) and models of its own
        self.objective = build_objective(cfg, spec, args, layout, device, tokenizer)
        self.dataloader = self.objective.loader if self.objective.loader is not None else build_dataloader(
            sources, cfg.training, self.batch.local_batch_size, layout.data_rank, layout.data_degree, cfg.debug.seed,
            device.type)
        self.objective.bind_data(self.dataloader)
        self.train_step = build_train_step(layout, cfg.training, args, self.model_parts, self.optimizers,
                                           self.lr_schedulers, device, sequence_loss=self.objective.loss)
        if self.train_step.pipeline is not None:
            logger.info("%s", self.train_step.pipeline.describe(cfg.parallelism.pipeline_parallel_microbatch_size))
        self.flops_per_token = args.flops_per_token(cfg.training.seq_len)
        self.throughput = ThroughputMeter(self.flops_per_token, peak_tflops(device, layout.param_dtype,
                                                                            cfg.metrics.peak_tflops), dims.world_size)
        self.memory = MemoryMonitor(device)
        self.compile_monitor = CompileMonitor(layout.compile_model or layout.compile_loss, device)
        self.tensor_memory = StepMemoryMeter(cfg.metrics.track_tensor_memory, self.model_parts, self.optimizers)
        self.metrics = MetricsLogger(cfg.metrics, self.run_folder, enabled=self.rank == 0, run_config=to_dict(cfg))
        self._pending: tuple | None = None  # a logged step's record, written once the next step is queued
        self._timed: StepValues | None = None  # the last written record's values: its step's end on the device
        self.step_clock = step_clock(device)  # CUDA: step ends marked by events; None on a CPU
        # [ops] profiling, phase timing, validation, evals, guard, GC (each inert unless its section enables it)
        self.profiler = Profiler(cfg.profiling, self.run_folder, self.rank, device)
        self.phases = PhaseTimer(cfg.profiling.enable_phase_timing, device, cfg.profiling.enable_profiling,
                                 listener=self.fault.phase)
        self.evaluation = InLoopEvaluation(cfg.validation, cfg.eval, cfg.training, held_out, eval_tasks, tokenizer,
                                           self.train_step, self.run_folder, self.rank == 0)
        self.guard = TrainingGuard(cfg.guard, cfg.debug.inject_nonfinite_loss_steps, not layout.loss_scaling, device)
        self.sdc = ReplicaCheck(cfg.fault, cfg.debug, layout.replica_mesh, not layout.zero1, self.model_parts,
                                self.optimizers, self.run_folder, self.rank, device,
                                lambda step: self.checkpointer.saves_at(step), self.train_step.reexecutable)  # [fault] SDC
        self.hooks = OperationsHooks(self.phases, self.guard, self.state, cfg.debug.inject_nonfinite_grad_step,
                                     self.sdc)
        self.gc = GarbageCollection(cfg.training.gc_freq)
        logger.info("global batch %d sequences (%d per rank x %d dp x %d accumulation) of %d tokens; "
                    "%.3g GFLOPs/token", self.batch.global_batch_size, self.batch.local_batch_size, dims.dp,
                    self.batch.grad_accum_steps, cfg.training.seq_len, self.flops_per_token / 1e9)

        # 5. Checkpoints: resume, or an initial load, or neither (each logged; docs/checkpointing.md).
        hf_adapter = spec.state_dict_adapter  # under LoRA, an HF initial load fills the base weights only
        if layout.lora is not None and hf_adapter is not None:
            hf_adapter = lora_adapter_class(hf_adapter)
        states = training_states(self.model_parts, self.optimizers, self.lr_schedulers, self.dataloader,
                                 self.state, dims.dp_rank, self.rank, device,
                                 adapter_only=layout.lora is not None and layout.lora.save_adapter_only)
        if self.offload is not None and self.offload.params is not None:
            states["model"] = ResidentModelState(states["model"], self.offload)
        states.update(self.objective.checkpoint_states())
        self.checkpointer = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, cfg.training.steps,
                                              cfg.comm.init_timeout_seconds, dims, states,
                                              ModelInfo(cfg.model.name, cfg.model.flavor, args, hf_adapter, hf_weights,
                                                        os.path.abspath(cfg.model.hf_assets_path) if
                                                        cfg.model.hf_assets_path else ""))
        self.checkpointer.load()
        # the objective's own models take the loaded (or initial) weights; its sampling uses the model being trained
        self.objective.start(self.state.step, self.train_step, self.batch.local_batch_size,
                             heartbeat=lambda: self.fault.mark("rollout"))
        if layout.replica_groups > 1:  # join the other replica groups (distributed/replica_ft.py)
            self.replicas = ReplicaGroups(cfg.fault, layout.replica_groups, layout.replica_id, device, states)
            self.replicas.install(self.model_parts)
            self.train_step.replicas = self.replicas

    def _write_config(self) -> None:
        text = to_toml(self.job_config)
        if self.rank == 0:
            os.makedirs(self.run_folder, exist_ok=True)
            with open(os.path.join(self.run_folder, "job_config.toml"), "w") as f:
                f.write(text)
        if self.job_config.job.print_config:
            logger.info("resolved config:\n%s", text)
        else:
            logger.info("resolved config: %s (--job.print_config prints it here)",
                        os.path.join(self.run_folder, "job_config.toml"))

    # ------------------------------------------------------------------------------ the loop
    def _should_log(self) -> bool:
        step, steps = self.state.step, self.job_config.training.steps
        return step == 1 or step % self.job_config.metrics.log_freq == 0 or step == steps

    def train(self) -> None:
        cfg = self.job_config
        if self.checkpointer.maybe_create_seed():  # --checkpoint.create_seed_checkpoint: step-0, no training
            return
        data_iter = iter(self.dataloader)
        tokens_per_step = self.batch.global_batch_size * cfg.training.seq_len
        logger.info("training for %d steps", cfg.training.steps)
        self.throughput.reset()
        self._timed = None
        self.phases.reset()
        self.memory.reset_peak()
        self.profiler.start(self.state.step)
        first_step = self.state.step + 1  # > 1 after a resume
        while self.state.step < cfg.training.steps:
            if self.replicas is not None and self._replica_quorum():  # [fault] rejoined: the live state
                data_iter = iter(self.dataloader)
                if self.state.step >= cfg.training.steps:
                    break
            self.state.step += 1
            self.gc.step(self.state.step)  # [ops] training.gc_freq
            self.phases.enter("data")
            t0 = time.perf_counter()
            batches = [next(data_iter) for _ in range(self.batch.grad_accum_steps)]
            data_time = time.perf_counter() - t0
            self.compile_monitor.start()
            with self.tensor_memory.track():
                out = self.train_step(batches, self.hooks)
            self._flush_log()  # the previous logged step's record: this step is queued behind it
            self.compile_monitor.stop(self.state.step)
            self.throughput.add_step(tokens_per_step, data_time)
            self.phases.end_step()
            self.state.add_tokens(out.tokens)
            logged = out.verdict in ("rollback", "abort")  # [ops] _guard_act logs the step first
            if logged and self._guard_act(out):  # rolled back
                if self._replay:  # guard.rollback_replay: the restored data position, read again
                    data_iter = iter(self.dataloader)
                continue
            if out.verdict == "replica_lost":
                logger.warning("step %d: a replica group was lost during the step; its update is skipped in every "
                               "surviving group (its batches are not trained on)", self.state.step)
            found = self.sdc.after_step(self.state.step)
            if found and self.sdc.policy != "warn" and self._sdc_act(found, out, logged):  # rolled back
                data_iter = iter(self.dataloader)  # the restored data position, read again
                continue
            evaluation = None
            if self.evaluation.due(self.state.step):  # [ops] validation sets, downstream tasks
                evaluation = self.evaluation.run(self.state.step, self.phases)
            if not logged and (self._should_log() or evaluation is not None or out.verdict is not None or found
                               or self.checkpointer.unreported_failure):
                self._log(out, evaluation, may_defer=True)
                logged = True
            if self.state.step == first_step:
                set_train_timeout(cfg.comm.train_timeout_seconds)
            self.phases.enter("checkpoint")
            stop = self.checkpointer.after_step(  # saves when due; True: preempted, stop now
                self.state.step, may_save=self.replicas is None or self.replicas.saver)
            self.phases.enter("profiler")
            self.profiler.step(self.state.step)
            self.phases.pause()
            if stop:
                if not logged:
                    self._log(out)  # the last step of this run is always in metrics.jsonl
                break
        if self.step_clock is not None:  # the last record is written once the device has finished its work
            self.step_clock.synchronize()
        self._flush_log()
        self.fault.finish()  # the loop has ended: a finished run is never declared hung (restarted)
        logger.info("training done: %d steps, %d tokens", self.state.step, self.state.tokens_seen)

    def _replica_quorum(self) -> bool:
        """The step's quorum of replica groups; True when this group received the live state."""
        self.fault.mark("quorum")
        wait = any(extensions.call("quorum", step=self.state.step + 1))  # plugins (utils/extensions.py)
        return self.replicas.begin_step(self.state.step, wait_for_all=wait)

    def _guard_act(self, out: StepResult) -> bool:
        """A bad step to abort on or roll back from (docs/guard.md), logged first. Abort raises on every
        rank; rollback restores the newest checkpoint but keeps the data position, or with
        guard.rollback_replay the first time restores it too (True: the loop continues after the restored
        step)."""
        self._log(out)
        if out.verdict == "abort":
            raise GuardAbort(self.guard.abort_message())
        bad = self.state.step
        self.fault.mark("checkpoint")
        self._replay = self.guard.replay(bad)
        restored = self.checkpointer.restore_latest(exclude=() if self._replay else ("dataloader",))
        if restored is None:
            logger.info("guard: no checkpoint to roll back to yet; step %d is skipped instead", bad)
            return False
        if self._replay:
            logger.info("guard: rolled back from step %d to step-%d with its data position: steps %d-%d run again on "
                        "the same data (guard.rollback_replay; if step %d is bad again, its data is skipped)", bad,
                        restored, restored + 1, bad, bad)
        else:
            logger.info("guard: rolled back from step %d to step-%d. The batches of steps %d-%d are skipped: step %d "
                        "runs again on the data that follows them", bad, restored, restored + 1, bad, restored + 1)
        self._restarted_from_checkpoint()
        return True

    def _sdc_act(self, found: list[Mismatch], out: StepResult, logged: bool) -> bool:
        """The replicas differ (components/fault/replica_check.py): the step is logged, then `abort` raises on every
        rank and `rollback` restores the newest checkpoint (saved after a clean check) with its data position: the
        lost steps train again on the same data (True: the loop continues after the restored step)."""
        if not logged:
            self._log(out)
        self.fault.mark("checkpoint")
        step, restored = self.state.step, self.checkpointer.restore_latest() if self.sdc.policy == "rollback" else None
        if restored is None:  # aborting, or no checkpoint yet
            raise CorruptionAbort(self.sdc.abort_message(step, found))
        logger.info("sdc: rolled back from step %d to step-%d (saved after a clean check); steps %d-%d run again on "
                    "the same data", step, restored, restored + 1, step)
        self._restarted_from_checkpoint()
        return True

    def _restarted_from_checkpoint(self) -> None:
        self.throughput.reset()
        self._timed = None
        self.phases.reset()

    def _log(self, out: StepResult, evaluation: dict | None = None, may_defer: bool = False) -> None:
        """Log a step. Its device values are copied to the host behind its work (`trainer/step_record.py`)
        and its host-side fields taken now; with `may_defer`, where `defers_log` allows, the record is
        written once the next step is queued (`_flush_log`), else at once."""
        self._flush_log()
        scaler = self.train_step.scaler
        immediate = [why for why, present in (
            ("verdict", out.verdict is not None), ("evaluation", evaluation is not None),
            ("loss scaling", scaler.enabled), ("phase timing", self.phases.enabled),
            ("replica groups", self.replicas is not None), ("checkpoint failure", self.checkpointer.unreported_failure),
        ) if present]
        at_end = {
            "memory_peak_gib": self.memory.peak_gib(),
            "memory_kind": self.memory.kind,
            **self.tensor_memory.record(),
            **self.compile_monitor.record(),
        }
        if scaler.enabled:
            at_end.update(loss_scale=scaler.value, skipped_steps=scaler.skipped_steps, step_skipped=not out.stepped)
        after = {**(evaluation or {}), **self.guard.record(), **self.fault.record(), **self.checkpointer.record(),
                 **self.sdc.record(), **self.objective.record()}
        self.memory.reset_peak()
        self._pending = (self.state.step, StepValues(out, self.state.tokens_on_device, self.step_clock), at_end,
                         after)
        if not (may_defer and defers_log(self.device, immediate)):
            self._flush_log()

    def _flush_log(self) -> None:
        """Write the record `_log` left pending, if any (waits for its step's values only)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, values, at_end, after = pending
        out = values.ready().out
        elapsed, self._timed = values.seconds_after(self._timed), values
        step_metrics = out.metrics()
        record = {
            "loss": step_metrics.pop("loss"),
            "grad_norm": step_metrics.pop("grad_norm"),
            "lr": step_metrics.pop("lr"),
            "tokens_seen": values.tokens_seen,
            **({"answer_tokens": int(out.tokens)} if self.job_config.training.dataset in (CHAT, PROMPTS) else {}),
            **self.throughput.summary(elapsed),
            **at_end,
        }
        record.update(step_metrics)  # z_loss, MoE metrics, extra losses
        record.update(**self.phases.summary(record["step_time_s"]), **after)  # [ops]
        if self.replicas is not None:
            record.update(self.replicas.record())
            if step == self.job_config.training.steps:
                record["state_digest"] = state_digest(self.replicas.states)
        self.metrics.log(step, record)

    def close(self, finished: bool = False) -> None:
        """Flush and release everything. `finished`: every rank completed normally, so they meet at a
        barrier first and tear the process group down together (a rank that destroys gloo's group
        while a peer still runs can abort at exit)."""
        self.fault.mark("shutdown")
        self.profiler.stop()
        self.gc.close()
        self.checkpointer.close()
        with contextlib.suppress(Exception):  # a run that failed after a logged step: its record still
            self._flush_log()  # (a device that failed cannot give it: the run's error says why)
        if self.offload is not None:
            self.offload.close()
        self.metrics.close()
        self.objective.close(finished)  # (generators apart stop)
        if self.replicas is not None:
            self.replicas.close()
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
        self.fault.close()
