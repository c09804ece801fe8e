"""The one place a `TrainStep` is built: training, the dry run and the planner's trace all call
`build_train_step`, so every option the job sets for the step (gradient clipping, z-loss, the MoE
balancer, the model's extra losses, an objective's own loss) reaches all three.

What differs by nature is passed in: the model parts, optimizers and schedules each caller built, the
device, the loss a post-training objective brings (`trainer/objective.py`), and -- in a fake world, where torch's
pipeline schedule cannot run -- the pipeline runner (`simulation/stage_step.py`). The run around the step (hooks,
replica groups) is the trainer's.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtrain.components.optim.lr_scheduler import LRSchedulersContainer
from torchtrain.components.optim.optimizer import OptimizersContainer
from torchtrain.config.training import Training
from torchtrain.distributed.layout import Layout
from torchtrain.trainer.extra_losses import ExtraLosses
from torchtrain.trainer.moe_balance import MoEBalancer
from torchtrain.trainer.sequence_loss import SequenceLoss
from torchtrain.trainer.step import PipelineFactory, TrainStep


def build_train_step(layout: Layout, training: Training, model_args, model_parts: list[nn.Module],
                     optimizers: OptimizersContainer, lr_schedulers: LRSchedulersContainer, device: torch.device,
                     pipeline: PipelineFactory | None = None, sequence_loss: SequenceLoss | None = None) -> TrainStep:
    """The job's train step over `model_parts`: clipping to `training.max_norm`, the z-loss of
    `training.z_loss`, a `MoEBalancer` for a mixture-of-experts model, `ExtraLosses` for a model that
    adds losses in its forward (multi-token prediction), and `sequence_loss`, the loss an objective brings (None:
    token-mean cross-entropy). `pipeline`: see `TrainStep`."""
    moe = MoEBalancer.for_model(model_parts, device, model_args)  # None unless the model has experts
    extra = ExtraLosses.for_model(model_parts, device)  # None unless a module adds a logged loss
    return TrainStep(layout, model_parts, optimizers, lr_schedulers, device, training.max_norm, moe,
                     training.z_loss, extra_losses=extra, pipeline=pipeline,
                     sequence_loss=sequence_loss)
