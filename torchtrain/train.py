"""The trainer: `torchrun ... -m torchtrain.train --job.config_file JOB.toml [--section.key value ...]`.

Reading order: `main` parses the job; `Trainer.__init__` checks everything that can be wrong with it
before any process group starts, then builds mesh -> model (meta) -> parallel plan -> weights ->
optimizer -> data -> metrics; `Trainer.train` runs the steps and `Trainer.train_step` is one step.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from torchtrain.components.data import build_dataloader, build_source
from torchtrain.components.hardware import MemoryMonitor, peak_tflops
from torchtrain.components.loss import ScaledTokenLoss, count_valid_tokens
from torchtrain.components.lr_scheduler import LRSchedulersContainer
from torchtrain.components.metrics import MetricsLogger, ThroughputMeter
from torchtrain.components.optimizer import OptimizersContainer
from torchtrain.components.tensor_memory import StepMemoryMeter
from torchtrain.components.tokenizer import build_tokenizer
from torchtrain.config import ConfigError, JobConfig, format_help, parse_args, resolve_batch, to_toml
from torchtrain.distributed import ParallelDims
from torchtrain.distributed.fsdp import resolve_param_dtype, set_gradient_sync
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.distributed.utils import (all_reduce, clip_grad_norm_, env_rank_world, init_distributed,
                                          resolve_device, set_determinism, set_train_timeout)
from torchtrain.models.registry import build_model_args, get_model_spec
from torchtrain.utils.logging import init_logger, is_log_rank, logger


class Trainer:
    def __init__(self, job_config: JobConfig):
        self.job_config = cfg = job_config
        self.rank, _, world_size = env_rank_world()

        # 1. Everything checkable without a process group, so a bad job fails fast on every rank.
        self.parallel_dims = pd = ParallelDims.from_config(cfg.parallelism, world_size)
        self.batch = resolve_batch(cfg.training, pd.dp)
        self.tokenizer = build_tokenizer(cfg.model.hf_assets_path)
        self.model_spec = spec = get_model_spec(cfg.model.name)
        self.model_args = build_model_args(spec, cfg.model.flavor, cfg.model.overrides)
        self.model_args.update_from_config(cfg, self.tokenizer)
        if spec.validate_fn is not None:
            spec.validate_fn(self.model_args, pd, cfg)
        if cfg.lr_scheduler.warmup_steps > cfg.training.steps:
            logger.warning("lr_scheduler.warmup_steps (%d) > training.steps (%d): the peak lr is never reached",
                           cfg.lr_scheduler.warmup_steps, cfg.training.steps)
        source = build_source(cfg.training.dataset, cfg.training.dataset_path, "train", cfg.debug.seed)

        # 2. Devices, process group, mesh, RNG.
        self.device = resolve_device(cfg.training.device)
        init_distributed(cfg.comm, self.device)
        pd.build_mesh(self.device.type)
        set_determinism(cfg.debug.seed, cfg.debug.deterministic)
        self._write_config()
        logger.info("%s | %d processes: %s | device %s | model %s/%s, %.2fM parameters",
                    cfg.job.description, world_size, pd.describe(), self.device, cfg.model.name,
                    cfg.model.flavor, self.model_args.num_params() / 1e6)

        # 3. Model: built on the meta device (no memory), parallelised, then materialised and
        #    initialised shard by shard with values that do not depend on the layout.
        with torch.device("meta"):
            model = spec.model_cls(self.model_args)
        model = spec.parallelize_fn(model, pd, cfg)
        model.to_empty(device=self.device)
        init_model_weights(model, cfg.debug.seed)
        model.train()
        self.model_parts = [model]
        self.loss_fn = ScaledTokenLoss()

        # 4. Optimizer, schedule, data, metrics.
        self.optimizers = OptimizersContainer(self.model_parts, cfg.optimizer, self.device)
        self.lr_schedulers = LRSchedulersContainer(self.optimizers, cfg.lr_scheduler, cfg.training.steps)
        self.dataloader = build_dataloader(source, self.tokenizer, cfg.training.seq_len,
                                           self.batch.local_batch_size, pd.dp_rank, pd.dp, cfg.debug.seed,
                                           shuffle=cfg.training.dataset_shuffle)
        param_dtype = resolve_param_dtype(cfg.training.mixed_precision_param, self.device.type)
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
        logger.info("global batch %d sequences (%d per rank x %d dp x %d accumulation) of %d tokens; "
                    "%.3g GFLOPs/token", self.batch.global_batch_size, self.batch.local_batch_size, pd.dp,
                    self.batch.grad_accum_steps, cfg.training.seq_len, self.flops_per_token / 1e9)

    def _write_config(self) -> None:
        text = to_toml(self.job_config)
        if self.rank == 0:
            os.makedirs(self.job_config.job.dump_folder, exist_ok=True)
            with open(os.path.join(self.job_config.job.dump_folder, "job_config.toml"), "w") as f:
                f.write(text)
        if self.job_config.job.print_config:
            logger.info("resolved config:\n%s", text)

    # ------------------------------------------------------------------------------ one step
    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Forward/backward over the step's micro-batches, clip, optimizer and LR step.

        Returns the global mean loss (over all ranks and micro-batches), the global grad norm, the lr
        used, and the global number of target tokens.
        """
        pd, model = self.parallel_dims, self.model_parts[0]
        local_tokens = sum(count_valid_tokens(labels) for _, labels in batches).to(self.device)
        global_tokens = all_reduce(local_tokens, pd.dp_mesh)
        self.loss_fn.scale = pd.dp / global_tokens.double()
        accumulated = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(batches):
            if len(batches) > 1:
                set_gradient_sync(self.model_parts, i == len(batches) - 1)
            logits = model(inputs.to(self.device, non_blocking=True))
            loss = self.loss_fn(logits, labels.to(self.device, non_blocking=True))
            del logits
            loss.backward()
            accumulated += loss.detach()
        params = [p for part in self.model_parts for p in part.parameters()]
        grad_norm = clip_grad_norm_(params, self.job_config.training.max_norm)
        lr = self.optimizers.lr
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        global_loss = all_reduce(accumulated / pd.dp, pd.dp_mesh)
        return {"loss": global_loss, "grad_norm": grad_norm, "lr": lr, "tokens": global_tokens}

    # ------------------------------------------------------------------------------ the loop
    def _should_log(self) -> bool:
        steps = self.job_config.training.steps
        return self.step == 1 or self.step % self.job_config.metrics.log_freq == 0 or self.step == steps

    def train(self) -> None:
        cfg = self.job_config
        data_iter = iter(self.dataloader)
        tokens_per_step = self.batch.global_batch_size * cfg.training.seq_len
        logger.info("training for %d steps", cfg.training.steps)
        self.throughput.reset()
        self.memory.reset_peak()
        while self.step < cfg.training.steps:
            self.step += 1
            t0 = time.perf_counter()
            batches = [next(data_iter) for _ in range(self.batch.grad_accum_steps)]
            data_time = time.perf_counter() - t0
            with self.tensor_memory.track():
                out = self.train_step(batches)
            self.throughput.add_step(tokens_per_step, data_time)
            self._tokens_seen += out["tokens"]
            if self._should_log():
                self._log(out)
            if self.step == 1:
                set_train_timeout(cfg.comm.train_timeout_seconds)
        logger.info("training done: %d steps, %d tokens", self.step, self.tokens_seen)

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
        self.metrics.log(self.step, record)
        self.memory.reset_peak()

    @property
    def tokens_seen(self) -> int:
        """Target tokens trained on so far, over all data-parallel ranks."""
        return int(self._tokens_seen.item())

    def close(self) -> None:
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _help_model(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith("--model.name="):
            return arg.split("=", 1)[1]
        if arg == "--model.name" and i + 1 < len(argv):
            return argv[i + 1]
    return "llama3"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    init_logger()
    if "-h" in argv or "--help" in argv:
        print(format_help(_help_model(argv)))
        return 0
    trainer = None
    try:
        trainer = Trainer(parse_args(argv))
        trainer.train()
    except ConfigError as e:
        if is_log_rank():
            print(f"torchtrain: config error: {e}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
        elif dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
