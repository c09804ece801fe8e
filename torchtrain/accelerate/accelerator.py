"""`Accelerator`: Hugging Face Accelerate's API for a plain training loop, over torchtrain's engine.

    accelerator = Accelerator(parallelism={"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
                              tp_plan={"blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.o": "rowwise"})
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

The layout is the trainer's (`layout.py` -> `distributed/layout.py::resolve_layout`), the model is
parallelised by `model.py`, the data sharded by `data.py`, checkpoints are DCP (`state.py`). What of
Accelerate's surface is not offered raises `NotSupportedError` naming it (`surface.py`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from torchtrain.accelerate import layout as layout_mod
from torchtrain.accelerate.data import PreparedDataLoader
from torchtrain.accelerate.model import parallelize
from torchtrain.accelerate.state import load_state, save_state
from torchtrain.accelerate.surface import UNSUPPORTED_METHODS, check_arguments, unsupported_method
from torchtrain.accelerate.wrappers import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    parameter_names,
    rebind_parameters,
)
from torchtrain.config.fields import ConfigError
from torchtrain.config.parallelism import Comm
from torchtrain.distributed.utils import clip_grad_norm_, init_distributed, resolve_device, set_gradient_sync

PARALLELISM_ENV = "TORCHTRAIN_PARALLELISM"
"""Read when `parallelism` is not given: the path of a TOML file with the [parallelism] table."""


class Accelerator:
    def __init__(self, mixed_precision: str | None = None, gradient_accumulation_steps: int = 1,
                 parallelism: dict | str | None = None, cpu: bool = False, split_batches: bool = True,
                 tp_plan: dict | None = None, fsdp_units=None, checkpoint_modules=None, compile_modules=None,
                 init_weights: Callable[[nn.Module], None] | None = None, **kwargs: Any):
        check_arguments(kwargs)
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ConfigError(f"Accelerator(gradient_accumulation_steps={gradient_accumulation_steps!r}) must be an "
                              f"integer >= 1")
        if parallelism is None:
            parallelism = os.environ.get(PARALLELISM_ENV) or None
        section = layout_mod.parse_parallelism(parallelism)
        self.device = resolve_device("cpu" if cpu else "auto")
        world = int(os.environ.get("WORLD_SIZE", 1))
        self.layout = layout_mod.resolve(section, mixed_precision or "no", world, self.device.type)
        init_distributed(Comm(), self.device)
        self.layout.dims.build_mesh(self.device.type)
        self.mixed_precision = mixed_precision or "no"
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.split_batches = split_batches
        self._model_options = dict(tp_plan=tp_plan, fsdp_units=fsdp_units, checkpoint_modules=checkpoint_modules,
                                   compile_modules=compile_modules, init_weights=init_weights)
        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._loaders: list[PreparedDataLoader] = []
        self._optimizer_models: list[nn.Module] = []
        self._names: dict[int, tuple[int, str]] = {}
        self._micro_step = 0
        self.sync_gradients = True

    # ------------------------------------------------------------------ who am I
    @property
    def num_processes(self) -> int:
        return dist.get_world_size()

    @property
    def process_index(self) -> int:
        return dist.get_rank()

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        dist.barrier()

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects: Any):
        """Models, optimizers, DataLoaders and LR schedulers, in any order; returned in the same order.
        Models are parallelised first (the optimizers then hold their new parameters)."""
        out: list[Any] = list(objects)
        for i, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                out[i] = self._prepare_model(obj)
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer):
                out[i] = self._prepare_optimizer(obj)
            elif isinstance(obj, DataLoader):
                out[i] = self._prepare_loader(obj)
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                out[i] = self._prepare_scheduler(obj)
            elif not isinstance(obj, nn.Module):
                raise ConfigError(f"Accelerator.prepare takes models, optimizers, DataLoaders and LR schedulers, "
                                  f"got {type(obj).__name__} (argument {i})")
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        index = len(self._models)
        self._names.update({k: (index, name) for k, name in parameter_names(model).items()})
        options = dict(self._model_options)
        if options["tp_plan"] is None:  # the model's own plan, as Hugging Face models declare it
            options["tp_plan"] = getattr(model, "_tp_plan", None) if self.layout.dims.tp_enabled else None
        model = parallelize(model, self.layout, self.device, **options)
        autocast = self.layout.autocast_dtype
        if autocast is not None:  # replicated strategies compute in bf16 through autocast (FSDP casts itself)
            model.forward = torch.autocast(self.device.type, dtype=autocast)(model.forward)
        self._models.append(model)
        return model

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        owner = self._names.get(id(first))
        if owner is None:
            raise ConfigError("prepare the optimizer together with (or after) the model it optimizes, built from "
                              "that model's parameters")
        model = self._models[owner[0]]
        rebind_parameters(optimizer, {k: name for k, (i, name) in self._names.items() if i == owner[0]}, model)
        wrapped = AcceleratedOptimizer(optimizer, lambda: self.sync_gradients)
        self._optimizers.append(wrapped)
        self._optimizer_models.append(model)
        return wrapped

    def _prepare_loader(self, loader: DataLoader) -> PreparedDataLoader:
        dims = self.layout.dims
        prepared = PreparedDataLoader(loader, dims.dp, dims.dp_rank, self.device, self.split_batches)
        self._loaders.append(prepared)
        return prepared

    def _prepare_scheduler(self, scheduler) -> AcceleratedScheduler:
        steps = 1 if self.split_batches else self.layout.dims.dp
        wrapped = AcceleratedScheduler(scheduler, lambda: self.sync_gradients, steps)
        self._schedulers.append(wrapped)
        return wrapped

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        (loss / self.gradient_accumulation_steps).backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module):
        """One micro-step: gradients are synchronised (and the optimizer steps) on every
        gradient_accumulation_steps-th call only."""
        self._micro_step += 1
        self.sync_gradients = self._micro_step % self.gradient_accumulation_steps == 0
        set_gradient_sync(models or self._models, self.sync_gradients)
        try:
            yield
        finally:
            set_gradient_sync(models or self._models, True)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip to the global L2 norm over every rank's gradients (FSDP/TP shards included); returns it."""
        if norm_type != 2.0:
            raise ConfigError(f"Accelerator.clip_grad_norm_(norm_type={norm_type}) : only the L2 norm (2.0) is "
                              f"supported")
        return clip_grad_norm_(list(parameters), max_norm)

    def gather_for_metrics(self, value: Any) -> Any:
        """Concatenate a tensor (0-d: stacked) from every data-parallel rank, in rank order (with split
        batches: the global batch's order)."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.gather_for_metrics(v) for v in value)
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"Accelerator.gather_for_metrics takes tensors, got {type(value).__name__}")
        value = value.detach()
        mesh = self.layout.dims.dp_mesh
        if mesh is None:
            return value.reshape(1) if value.dim() == 0 else value
        parts = [torch.empty_like(value) for _ in range(mesh.size())]
        dist.all_gather(parts, value.contiguous(), group=mesh.get_group())
        return torch.stack(parts) if value.dim() == 0 else torch.cat(parts)

    # ------------------------------------------------------------------ state
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The model itself: wrappers are applied in place (parameter names unchanged)."""
        return model

    def _pairs(self):
        return [(m, o.optimizer) for m, o in zip(self._optimizer_models, self._optimizers)]

    def save_state(self, output_dir: str, **kwargs) -> None:
        save_state(output_dir, self._models, self._pairs(), self._schedulers, self._loaders)

    def load_state(self, input_dir: str, **kwargs) -> None:
        load_state(input_dir, self._models, self._pairs(), self._schedulers, self._loaders)

    def __getattr__(self, name: str):
        if name in UNSUPPORTED_METHODS:
            raise unsupported_method(name)
        raise AttributeError(f"'Accelerator' object has no attribute {name!r}")
