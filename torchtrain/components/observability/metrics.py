"""Step metrics: throughput / MFU arithmetic and the rank-0 sinks (console, metrics.jsonl, TensorBoard,
Weights & Biases: `wandb_sink.py`).

Definitions (per logging interval of k steps taking t seconds of wall time):

* tokens/s per device = (global tokens trained in the interval) / t / world_size
* TFLOPs per device   = tokens/s per device x flops_per_token / 1e12
* MFU                 = TFLOPs per device / peak TFLOP/s of the device (n/a when the peak is unknown)
* data loading %      = time spent waiting for batches / t

metrics.jsonl is strict JSON: a non-finite value (a NaN loss) is written as null and named under
"non_finite" (`utils/strict_json.py`); `strict_json.read_jsonl` reads it back with the floats restored.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from torchtrain.config.job import Metrics
from torchtrain.utils import strict_json
from torchtrain.utils.logging import logger


class ThroughputMeter:
    def __init__(self, flops_per_token: int, peak_tflops: float | None, world_size: int):
        self.flops_per_token, self.peak, self.world_size = flops_per_token, peak_tflops, world_size
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.steps = 0
        self.data_time = 0.0

    def add_step(self, global_tokens: int, data_time: float) -> None:
        self.tokens += global_tokens
        self.steps += 1
        self.data_time += data_time

    def summary(self, elapsed: float | None = None) -> dict[str, float | None]:
        """The steps added since the last summary (or reset); `elapsed`: their seconds where the caller
        measured them (on the device), else the wall time since then."""
        elapsed = max(time.perf_counter() - self.t0 if elapsed is None else elapsed, 1e-9)
        tps = self.tokens / elapsed / self.world_size
        tflops = tps * self.flops_per_token / 1e12
        out = {
            "tokens_per_s_per_device": tps,
            "tflops_per_device": tflops,
            "mfu_pct": 100.0 * tflops / self.peak if self.peak else None,
            "step_time_s": elapsed / max(self.steps, 1),
            "data_loading_s": self.data_time / max(self.steps, 1),
            "data_loading_pct": 100.0 * self.data_time / elapsed,
        }
        self.reset()
        return out


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plain numbers of a record (what TensorBoard and W&B plot)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLogger:
    """Writes one record per logged step to the console, `metrics.jsonl`, TensorBoard and W&B (rank 0
    only). `run_config`: the resolved job config, recorded by W&B."""

    def __init__(self, cfg: Metrics, dump_folder: str, enabled: bool, run_config: dict[str, Any] | None = None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a", buffering=1)
        if cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(dump_folder, cfg.save_tb_folder))
        if cfg.enable_wandb:
            from torchtrain.components.observability.wandb_sink import WandbSink

            self._wandb = WandbSink(cfg, dump_folder, run_config or {})

    def log(self, step: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **record}
        self._jsonl.write(strict_json.dumps(record) + "\n")  # NaN/inf: null + "non_finite" (docs/metrics.md)
        if self._tb is not None:
            for key, value in _scalars(record).items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(step, _scalars(record))
        extra = ""  # mixture-of-experts models: auxiliary loss and expert load imbalance (docs/moe.md)
        if "moe_load_max_mean" in record:
            extra = f" | moe aux {_fmt(record.get('moe_aux_loss'), '.4f')} load max/mean " \
                  f"{_fmt(record['moe_load_max_mean'], '.2f')}"
        if "z_loss" in record:  # training.z_loss (docs/optimizers.md)
            extra += f" | z-loss {_fmt(record['z_loss'], '.3e')}"
        if "mtp_loss" in record:  # multi-token prediction (docs/moe.md)
            extra += f" | mtp {_fmt(record['mtp_loss'], '.4f')}"
        if "dpo/accuracy" in record:  # preference optimisation: what the recipe promises (docs/post_training.md)
            extra += f" | dpo acc {_fmt(record['dpo/accuracy'], '.3f')} margin {_fmt(record.get('dpo/reward_margin'), '.3f')}"
        if "grpo/reward" in record:  # GRPO: the rollout's reward, KL, length and sampling rate
            extra += (f" | reward {_fmt(record['grpo/reward'], '.3f')} kl {_fmt(record.get('grpo/kl'), '.2e')} "
                      f"len {_fmt(record.get('grpo/completion_length'), '.1f')} "
                      f"gen tok/s {_fmt(record.get('grpo/generation_tokens_per_s'), ',.0f')}")
        # the time the step waited for its batch: for GRPO that is sampling the rollout
        waited = "rollout" if "grpo/reward" in record else "data"
        logger.info(
            "step %5d | loss %s | grad_norm %s | lr %s | tok/s/dev %s | TFLOPs %s | MFU %s | "
            "mem %s GiB (%s) | %s %s%%%s",
            step, _fmt(record.get("loss"), ".4f"), _fmt(record.get("grad_norm"), ".3f"),
            _fmt(record.get("lr"), ".2e"), _fmt(record.get("tokens_per_s_per_device"), ",.0f"),
            _fmt(record.get("tflops_per_device"), ".3f"), _fmt(record.get("mfu_pct"), ".1f"),
            _fmt(record.get("memory_peak_gib"), ".2f"), record.get("memory_kind", "?"),
            waited, _fmt(record.get("data_loading_pct"), ".1f"), extra,
        )

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
