"""The trainer: `torchrun ... -m torchtrain.train --job.config_file JOB.toml [--section.key value ...]`.

Reading order: `main` parses the job; `Trainer.__init__` checks everything that can be wrong with it
before any process group starts, then builds mesh -> model (meta) -> parallel plan -> weights ->
optimizer -> data -> metrics; `Trainer.train` runs the steps and `Trainer.train_step` is one step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from torchtrain.components.checkpoint import CheckpointManager
from torchtrain.components.data import build_dataloader, build_source
from torchtrain.components.gc_control import GarbageCollection
from torchtrain.components.guard import GuardAbort, TrainingGuard
from torchtrain.components.hardware import MemoryMonitor, peak_tflops
from torchtrain.components.loss import ScaledTokenLoss, count_valid_tokens, cross_entropy_sum, local_value
from torchtrain.components.lr_scheduler import LRSchedulersContainer
from torchtrain.components.metrics import MetricsLogger, ThroughputMeter
from torchtrain.components.optimizer import OptimizersContainer
from torchtrain.components.phases import PhaseTimer
from torchtrain.components.precision import LossScaler
from torchtrain.components.profiling import Profiler
from torchtrain.components.tensor_memory import StepMemoryMeter
from torchtrain.components.validation import Validator, build_validation_source
from torchtrain.config import ConfigError, JobConfig, format_help, parse_args, to_toml
from torchtrain.distributed.cluster import check_cluster
from torchtrain.distributed.compile import compile_loss
from torchtrain.distributed.fsdp import resolve_param_dtype
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.distributed.pipeline import build_schedule, keep_modules, schedule_timeline
from torchtrain.distributed.tensor_parallel import maybe_loss_parallel
from torchtrain.distributed.utils import (all_reduce, clip_grad_norm_, env_rank_world, exit_process, init_distributed,
                                          resolve_device, set_determinism, set_gradient_sync,
                                          set_train_timeout)
from torchtrain.preflight import preflight
from torchtrain.utils.logging import init_logger, is_log_rank, logger


class Trainer:
    def __init__(self, job_config: JobConfig):
        self.job_config = cfg = job_config
        self.rank, _, world_size = env_rank_world()

        # 1. Everything checkable without a process group, so a bad job fails fast on every rank.
        self.device = resolve_device(cfg.training.device)
        plan = preflight(cfg, world_size, self.device.type)
        self.parallel_dims = pd = plan.parallel_dims
        self.batch, self.tokenizer, self.pp_plan = plan.batch, plan.tokenizer, plan.pp_plan
        self.model_spec = spec = plan.model_spec
        self.model_args = plan.model_args
        if cfg.lr_scheduler.warmup_steps > cfg.training.steps:
            logger.warning("lr_scheduler.warmup_steps (%d) > training.steps (%d): the peak lr is never reached",
                           cfg.lr_scheduler.warmup_steps, cfg.training.steps)
        source = build_source(cfg.training.dataset, cfg.training.dataset_path, "train", cfg.debug.seed)
        val_source = build_validation_source(cfg)  # None unless [validation] enable
        CheckpointManager.preflight(cfg)

        # 2. Process group, mesh, RNG.
        init_distributed(cfg.comm, self.device)
        pd.build_mesh(self.device.type)
        set_determinism(cfg.debug.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
        self._write_config()
        check_cluster(cfg)  # logs the launch; a multi-node checkpoint folder must be shared
        logger.info("%s | %d processes: %s | device %s | model %s/%s, %.2fM parameters",
                    cfg.job.description, world_size, pd.describe(), self.device, cfg.model.name,
                    cfg.model.flavor, self.model_args.num_params() / 1e6)

        # 3. Model: built on the meta device (no memory), cut into this rank's pipeline stages (or
        #    kept whole), parallelised, then materialised and initialised shard by shard with values
        #    that do not depend on the layout.
        compile_ce = cfg.compile.enable and "loss" in cfg.compile.components
        self.loss_fn = ScaledTokenLoss(compile_loss(cross_entropy_sum) if compile_ce else cross_entropy_sum)
        with torch.device("meta"):
            whole = spec.model_cls(self.model_args)
        if self.pp_plan is None:
            self.model_parts = [self._materialize(spec.parallelize_fn(whole, pd, cfg))]
        else:
            self._build_pipeline(whole)

        # 4. Precision, optimizer, schedule, data, metrics.
        param_dtype = resolve_param_dtype(cfg.training.mixed_precision_param, self.device.type)
        replicated = cfg.parallelism.data_parallel_strategy in ("ddp", "zero1")
        # FSDP casts parameters itself (mixed-precision policy); replicated strategies use autocast.
        self.autocast_dtype = param_dtype if replicated and param_dtype != torch.float32 else None
        self.scaler = LossScaler(param_dtype == torch.float16, sharded=not replicated, device=self.device)
        zero1 = cfg.parallelism.data_parallel_strategy == "zero1" and pd.dp_enabled
        state_device = torch.device("cpu") if cfg.training.enable_cpu_offload else self.device
        self.optimizers = OptimizersContainer(self.model_parts, cfg.optimizer, state_device,
                                              zero1_group=pd.dp_mesh.get_group() if zero1 else None)
        self.lr_schedulers = LRSchedulersContainer(self.optimizers, cfg.lr_scheduler, cfg.training.steps)
        self.dataloader = build_dataloader(source, self.tokenizer, cfg.training.seq_len,
                                           self.batch.local_batch_size, pd.dp_rank, pd.dp, cfg.debug.seed,
                                           shuffle=cfg.training.dataset_shuffle)
        self.flops_per_token = self.model_args.flops_per_token(cfg.training.seq_len)
        self.throughput = ThroughputMeter(self.flops_per_token,
                                          peak_tflops(self.device, param_dtype, cfg.metrics.peak_tflops),
                                          world_size)
        self.memory = MemoryMonitor(self.device)
        self.tensor_memory = StepMemoryMeter(cfg.metrics.track_tensor_memory, self.model_parts, self.optimizers)
        self.metrics = MetricsLogger(cfg.job.dump_folder, cfg.metrics.enable_tensorboard,
                                     cfg.metrics.save_tb_folder, enabled=self.rank == 0)
        self.step = 0
        self._tokens_seen = torch.zeros((), dtype=torch.int64, device=self.device)
        # [ops] profiling, phase timing, validation, guard, GC (each inert unless its section enables it)
        self.profiler = Profiler(cfg.profiling, cfg.job.dump_folder, self.rank, self.device)
        self.phases = PhaseTimer(cfg.profiling.enable_phase_timing, self.device, cfg.profiling.enable_profiling)
        self.validator = Validator(self, val_source) if val_source is not None else None
        self.guard = TrainingGuard(cfg.guard, cfg.debug.inject_nonfinite_loss_steps,
                                   check_grad_norm=not self.scaler.enabled, device=self.device)
        self.gc = GarbageCollection(cfg.training.gc_freq)
        logger.info("global batch %d sequences (%d per rank x %d dp x %d accumulation) of %d tokens; "
                    "%.3g GFLOPs/token", self.batch.global_batch_size, self.batch.local_batch_size, pd.dp,
                    self.batch.grad_accum_steps, cfg.training.seq_len, self.flops_per_token / 1e9)

        # 5. Checkpoints: resume, or an initial load, or neither (each logged; docs/checkpointing.md).
        self.checkpointer = CheckpointManager(cfg, pd, self.model_parts, self.optimizers, self.lr_schedulers,
                                              self.dataloader, self, spec, self.model_args, self.device)
        self.checkpointer.load()

    def _materialize(self, part: torch.nn.Module) -> torch.nn.Module:
        offload = self.job_config.training.enable_cpu_offload
        part.to_empty(device="cpu" if offload else self.device)
        if offload:  # the sharded state lives in host memory, buffers (RoPE tables) on the GPU
            for module in part.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.to(self.device)
        init_model_weights(part, self.job_config.debug.seed)
        return part.train()

    def _build_pipeline(self, whole: torch.nn.Module) -> None:
        from torch.distributed.pipelining import PipelineStage

        pd, plan, cfg = self.parallel_dims, self.pp_plan, self.job_config
        self.model_parts, stages = [], []
        for stage_id in plan.stage_ids(pd.pp_rank, pd.pp):
            part = keep_modules(whole, plan.modules_per_stage[stage_id])
            part = self._materialize(self.model_spec.parallelize_fn(part, pd, cfg))
            self.model_parts.append(part)
            stages.append(PipelineStage(part, stage_id, plan.num_stages, self.device, group=pd.pp_mesh.get_group()))
        self.pp_schedule = build_schedule(plan, stages, self.loss_fn)
        self.pp_has_first = any(s.is_first for s in stages)
        self.pp_has_last = any(s.is_last for s in stages)
        timeline = schedule_timeline(self.pp_schedule, plan)
        logger.info("pipeline: %s, %d stages (%d per rank), %d micro-batches of %d; bubble %.1f%% "
                    "(GPipe/1F1B formula (p-1)/(m+p-1) = %.1f%%)\n%s\nstages: %s",
                    plan.schedule_name, plan.num_stages, plan.stages_per_rank, plan.n_microbatches,
                    cfg.parallelism.pipeline_parallel_microbatch_size, 100 * timeline.bubble_fraction,
                    100 * (pd.pp - 1) / (plan.n_microbatches + pd.pp - 1), timeline.render(),
                    " | ".join(f"{i}: {', '.join(m)}" for i, m in enumerate(plan.modules_per_stage)))

    # The train state a checkpoint restores (with model, optimizer, schedule, data and RNG).
    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self._tokens_seen.fill_(int(state["tokens_seen"]))

    def _write_config(self) -> None:
        text = to_toml(self.job_config)
        if self.rank == 0:
            os.makedirs(self.job_config.job.dump_folder, exist_ok=True)
            with open(os.path.join(self.job_config.job.dump_folder, "job_config.toml"), "w") as f:
                f.write(text)
        if self.job_config.job.print_config:
            logger.info("resolved config:\n%s", text)

    # ------------------------------------------------------------------------------ one step
    def train_context(self) -> contextlib.ExitStack:
        """Forward + backward context: loss parallel under TP, autocast for replicated strategies."""
        stack = contextlib.ExitStack()
        stack.enter_context(maybe_loss_parallel(self.parallel_dims.loss_parallel_enabled))
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
        return stack

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Forward/backward over the step's micro-batches, clip, optimizer and LR step.

        Returns the global mean loss (over all ranks and micro-batches), the global grad norm, the lr
        used, and the global number of target tokens.
        """
        pd, model = self.parallel_dims, self.model_parts[0]
        self.phases.enter("forward_backward")  # [ops]
        local_tokens = sum(count_valid_tokens(labels) for _, labels in batches).to(self.device)
        global_tokens = all_reduce(local_tokens, pd.dp_mesh)
        self.loss_fn.scale = pd.dp / global_tokens.double()
        if self.guard.inject_nan(self.step):  # [ops] debug.inject_nonfinite_loss_steps
            self.loss_fn.scale = self.loss_fn.scale * float("nan")
        accumulated = torch.zeros((), device=self.device)
        if self.pp_plan is not None:  # accumulation happens through the schedule's micro-batches
            accumulated += self._pipeline_step(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
            batches = []
        for i, (inputs, labels) in enumerate(batches):
            if len(batches) > 1:
                set_gradient_sync(self.model_parts, i == len(batches) - 1)
            with self.train_context():
                logits = model(inputs.to(self.device, non_blocking=True))
                loss = self.loss_fn(logits, labels.to(self.device, non_blocking=True))
                del logits
                self.scaler.scale(loss).backward()
            accumulated += local_value(loss.detach()).float()
        self.phases.enter("optimizer")  # [ops]
        if self.step == self.job_config.debug.inject_nonfinite_grad_step:
            self._inject_nonfinite_grad()
        self.scaler.unscale_(self.optimizers)
        params = [p for part in self.model_parts for p in part.parameters()]
        grad_norm = clip_grad_norm_(params, self.job_config.training.max_norm, pd.pp_mesh)
        lr = self.optimizers.lr
        global_loss = all_reduce(accumulated / pd.dp, pd.dp_mesh)
        if pd.pp_enabled:  # only last-stage ranks hold a loss; the sum reaches every stage
            global_loss = all_reduce(global_loss, pd.pp_mesh)
        guard = self.guard.check(self.step, global_loss, grad_norm)  # [ops] agreed by all ranks, before the step
        stepped = self.scaler.step(self.optimizers) if guard is None else self.scaler.skip(self.optimizers)
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.phases.pause()
        return {"loss": global_loss, "grad_norm": grad_norm, "lr": lr, "tokens": global_tokens,
                "stepped": stepped, "guard": guard}

    def _pipeline_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One schedule step over the local batch; returns this rank's summed (scaled) loss."""
        losses: list[torch.Tensor] | None = [] if self.pp_has_last else None
        targets = labels.to(self.device) if self.pp_has_last else None
        args = (inputs.to(self.device),) if self.pp_has_first else ()
        with self.train_context():
            self.pp_schedule.step(*args, target=targets, losses=losses)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([local_value(l.detach()).float() for l in losses]).sum()

    def _inject_nonfinite_grad(self) -> None:
        """debug.inject_nonfinite_grad_step: poison one gradient with +inf (fault injection)."""
        from torch.distributed.tensor import DTensor

        grad = next(p.grad for part in self.model_parts for p in part.parameters() if p.grad is not None)
        (grad.to_local() if isinstance(grad, DTensor) else grad).fill_(float("inf"))
        logger.warning("step %d: injected +inf into a gradient (debug.inject_nonfinite_grad_step)", self.step)

    # ------------------------------------------------------------------------------ the loop
    def _should_log(self) -> bool:
        steps = self.job_config.training.steps
        return self.step == 1 or self.step % self.job_config.metrics.log_freq == 0 or self.step == steps

    def train(self) -> None:
        cfg = self.job_config
        if self.checkpointer.maybe_create_seed():  # --checkpoint.create_seed_checkpoint: step-0, no training
            return
        data_iter = iter(self.dataloader)
        tokens_per_step = self.batch.global_batch_size * cfg.training.seq_len
        logger.info("training for %d steps", cfg.training.steps)
        self.throughput.reset()
        self.phases.reset()
        self.memory.reset_peak()
        self.profiler.start(self.step)
        first_step = self.step + 1  # > 1 after a resume
        while self.step < cfg.training.steps:
            self.step += 1
            self.gc.step(self.step)  # [ops] training.gc_freq
            self.phases.enter("data")
            t0 = time.perf_counter()
            batches = [next(data_iter) for _ in range(self.batch.grad_accum_steps)]
            data_time = time.perf_counter() - t0
            with self.tensor_memory.track():
                out = self.train_step(batches)
            self.throughput.add_step(tokens_per_step, data_time)
            self.phases.end_step()
            self._tokens_seen += out["tokens"]
            if out["guard"] in ("rollback", "abort") and self._guard_act(out):  # [ops] True: rolled back
                continue
            if self.validator is not None and self.validator.due(self.step):  # [ops]
                self.phases.enter("validation")
                out["validation"] = self.validator.run(self.step)
                self.phases.pause()
            logged = self._should_log() or "validation" in out or out["guard"] is not None
            if logged and not out.get("logged"):
                self._log(out)
            if self.step == first_step:
                set_train_timeout(cfg.comm.train_timeout_seconds)
            self.phases.enter("checkpoint")
            stop = self.checkpointer.after_step(self.step)  # saves when due; True: preempted, stop now
            self.phases.enter("profiler")
            self.profiler.step(self.step)
            self.phases.pause()
            if stop:
                if not out.get("logged"):
                    self._log(out)  # the last step of this run is always in metrics.jsonl
                break
        logger.info("training done: %d steps, %d tokens", self.step, self.tokens_seen)

    def _guard_act(self, out: dict) -> bool:
        """A bad step to abort on or roll back from (docs/guard.md), logged first. Abort raises on every
        rank; rollback restores the newest checkpoint but keeps the data position (True: the loop
        continues after the restored step)."""
        self._log(out)
        if out["guard"] == "abort":
            raise GuardAbort(self.guard.abort_message())
        bad = self.step
        restored = self.checkpointer.restore_latest(exclude=("dataloader",))
        if restored is None:
            logger.info("guard: no checkpoint to roll back to yet; step %d is skipped instead", bad)
            return False
        logger.info("guard: rolled back from step %d to step-%d. The batches of steps %d-%d are skipped: step %d runs "
                    "again on the data that follows them", bad, restored, restored + 1, bad, restored + 1)
        self.throughput.reset()
        self.phases.reset()
        return True

    def _log(self, out: dict[str, torch.Tensor]) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        record = {
            "loss": out["loss"].item(),
            "grad_norm": out["grad_norm"].item(),
            "lr": out["lr"],
            "tokens_seen": self.tokens_seen,
            **self.throughput.summary(),
            "memory_peak_gib": self.memory.peak_gib(),
            "memory_kind": self.memory.kind,
            **self.tensor_memory.record(),
        }
        if self.scaler.enabled:
            record.update(loss_scale=self.scaler.value, skipped_steps=self.scaler.skipped_steps,
                          step_skipped=not out["stepped"])
        record.update(**self.phases.summary(record["step_time_s"]), **out.get("validation", {}),
                      **self.guard.record())  # [ops]
        self.metrics.log(self.step, record)
        out["logged"] = True
        self.memory.reset_peak()

    @property
    def tokens_seen(self) -> int:
        """Target tokens trained on so far, over all data-parallel ranks."""
        return int(self._tokens_seen.item())

    def close(self, finished: bool = False) -> None:
        """Flush and release everything. `finished`: every rank completed normally, so they meet at a
        barrier first and tear the process group down together (a rank that destroys gloo's group
        while a peer still runs can abort at exit)."""
        self.profiler.stop()
        self.gc.close()
        self.checkpointer.close()
        self.metrics.close()
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


# torchrun stops all workers as soon as one fails; a quiet rank that failed first would cut the log
# rank off before it printed the error.
QUIET_RANK_ERROR_EXIT_DELAY_S = 5.0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    init_logger()
    if "-h" in argv or "--help" in argv:
        print(format_help(argv))
        return 0
    trainer, finished = None, False
    try:
        trainer = Trainer(parse_args(argv))
        trainer.train()
        finished = True
    except ConfigError as e:
        if is_log_rank():
            print(f"torchtrain: config error: {e}", file=sys.stderr)
        else:  # every rank finds the error at once: let the log rank say it before torchrun stops the job
            time.sleep(QUIET_RANK_ERROR_EXIT_DELAY_S)
        return 2
    except GuardAbort as e:  # every rank raises it at the same step (docs/guard.md)
        finished = True  # ... so they can still tear down together
        if is_log_rank():
            print(f"torchtrain: guard: {e}", file=sys.stderr)
        return 3
    finally:
        if trainer is not None:
            trainer.close(finished)
        elif dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())  # see exit_process: a clean run must not abort in interpreter teardown
