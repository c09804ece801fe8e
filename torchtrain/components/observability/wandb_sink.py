"""Weights & Biases as a metrics backend beside TensorBoard (`metrics.enable_wandb`, rank 0 only).

Optional: `pip install "torchtrain[wandb]"` (preflight checks the package is there, so a missing one is
a config error before start-up, not a failure on rank 0 alone). The run gets a name
(`metrics.wandb_run_name`, $WANDB_NAME, else the dump folder's name), a project
(`metrics.wandb_project`, $WANDB_PROJECT, else "torchtrain"), the job description as notes and the
resolved job config as its config; it lives under `{dump_folder}/wandb/`. With
`metrics.wandb_mode = "offline"` (or WANDB_MODE=offline) nothing touches the network; `wandb sync`
uploads the run later. Everything else (entity, resuming a run by id, tags) is W&B's own environment
variables.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from torchtrain.config.fields import ConfigError
from torchtrain.config.job import Metrics
from torchtrain.utils.logging import logger


def check_wandb(cfg: Metrics) -> None:
    """ConfigError when W&B is enabled but the package is not installed."""
    if cfg.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("[metrics.enable_wandb] needs the wandb package: pip install \"torchtrain[wandb]\" "
                          "(or pip install wandb), or set metrics.enable_wandb = false")


class WandbSink:
    """One W&B run: `log(step, scalars)` per logged step, `close()` at the end."""

    def __init__(self, cfg: Metrics, dump_folder: str, run_config: dict[str, Any]):
        import wandb

        name = cfg.wandb_run_name or os.environ.get("WANDB_NAME") or os.path.basename(os.path.abspath(dump_folder))
        project = cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "torchtrain"
        self.run = None
        try:
            self.run = wandb.init(project=project, name=name, notes=run_config.get("job", {}).get("description"),
                                  config=run_config, dir=dump_folder, mode=cfg.wandb_mode)
        except Exception as e:  # noqa: BLE001 -- e.g. online without credentials: train on, say so
            # Only rank 0 gets here: raising would leave the other ranks waiting in a collective.
            logger.error("metrics.enable_wandb: W&B run not started (%s: %s); metrics still go to the "
                         "console, metrics.jsonl and TensorBoard", type(e).__name__, e)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log(scalars, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
