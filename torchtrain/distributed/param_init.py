"""Layout-independent, deterministic parameter initialisation.

Initial weights must be bitwise identical whether a parameter lives whole on one process or as a
shard of a DTensor (FSDP, TP, HSDP, a pipeline stage), so that every layout trains the same model.
Seeding one RNG and initialising shards in place cannot give that (the draws would depend on the
shard's size and order), so each parameter is generated from counter-based seeds instead:

* the parameter's global tensor is cut into fixed blocks of rows (a block's size depends only on the
  global shape), and block b is drawn from a generator seeded with hash(seed, canonical name, b);
* a rank holding rows [r0, r1) (and any column range) of the global tensor draws just the blocks that
  cover r0..r1 and copies out its slice.

The values therefore depend on (seed, parameter name, global shape, device type) only, not on the torch
version (`_truncated_normal`). Cost per rank is its local rows x the full row width, never the whole tensor
(unless the shard is the whole tensor).

A model whose initialisation is code acting on whole modules (a Hugging Face model's `_init_weights`)
supplies `init_module(module)` instead of `init_spec`: each module's own parameters and buffers are
made whole on the host, the model's code initialises them under a torch seed keyed by (seed, the
module's canonical name), and each rank copies out its slice (`init_by_modules`). The values depend on
(seed, module name, global shapes) only, as above; each rank draws every whole tensor once.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import InitSpec
from torchtrain.models.converters.lora import adapter_init_spec

BLOCK_NUMEL = 1 << 20  # elements per generator block (whole rows, at least one row)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    """Parameter name with activation-checkpoint / compile / FSDP1 wrapper segments removed."""
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def _block_seed(seed: int, fqn: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{fqn}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _draw(spec: InitSpec, numel: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if spec.kind == "normal":
        return out.normal_(spec.mean, spec.std, generator=gen)
    if spec.kind == "trunc_normal":
        return _truncated_normal(out, spec.mean, spec.std, spec.truncate, gen)
    if spec.kind == "log_uniform":
        return out.uniform_(spec.low, spec.high, generator=gen).log_()
    raise ValueError(f"unknown init kind {spec.kind!r}")


def _truncated_normal(out: torch.Tensor, mean: float, std: float, truncate: float,
                      gen: torch.Generator) -> torch.Tensor:
    """N(mean, std^2) cut at mean +- truncate * std, by rejection: the whole tensor is drawn, then drawn again
    wherever a value fell outside, until none does. Kept here rather than left to `nn.init.trunc_normal_`, whose
    method changed between torch releases (2.11 maps uniform draws through the inverse normal CDF, 2.13 rejects as
    here): initial weights are then the same on every torch version (the one on a GPU image and on a laptop).
    The draws are those of torch 2.13's `trunc_normal_` for these bands (bounds rounded to the tensor's dtype)."""
    lo = out.new_tensor(mean - truncate * std, device="cpu").item()
    hi = out.new_tensor(mean + truncate * std, device="cpu").item()
    values = out.normal_(mean, std, generator=gen)
    while bool((outside := (values < lo) | (values > hi)).any()):
        values = torch.where(outside, torch.empty_like(values).normal_(mean, std, generator=gen), values)
    return values


def global_rows(spec: InitSpec, fqn: str, seed: int, shape: tuple[int, ...], r0: int, r1: int,
                device: torch.device) -> torch.Tensor:
    """Rows [r0, r1) of the parameter's global tensor (the same values whoever asks)."""
    shape = tuple(shape) or (1,)
    row_numel = math.prod(shape[1:])
    rows_per_block = max(1, BLOCK_NUMEL // max(row_numel, 1))
    first, last = r0 // rows_per_block, (r1 - 1) // rows_per_block
    blocks = []
    for b in range(first, last + 1):
        n_rows = min(rows_per_block, shape[0] - b * rows_per_block)
        blocks.append(_draw(spec, n_rows * row_numel, _block_seed(seed, fqn, b), device))
    rows = torch.cat(blocks).view(-1, *shape[1:])
    start = r0 - first * rows_per_block
    return rows[start : start + (r1 - r0)]


def _local_region(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the part of the parameter this rank holds."""
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(shape), tuple(offset)
    return tuple(param.shape), (0,) * param.dim()


@torch.no_grad()
def init_parameter(param: torch.Tensor, spec: InitSpec, fqn: str, seed: int) -> None:
    local = param.to_local() if isinstance(param, DTensor) else param.data
    if local.numel() == 0:
        return
    if spec.kind in ("ones", "zeros"):
        local.fill_(1.0 if spec.kind == "ones" else 0.0)
        return
    shape, offset = _local_region(param)
    if param.dim() == 0:
        local.copy_(global_rows(spec, fqn, seed, (), 0, 1, local.device).view(()))
        return
    rows = global_rows(spec, fqn, seed, tuple(param.shape), offset[0], offset[0] + shape[0], local.device)
    for dim in range(1, len(shape)):
        rows = rows.narrow(dim, offset[dim], shape[dim])
    local.copy_(rows.view(local.shape))


def init_model_weights(model: nn.Module, seed: int, loaded: bool = False) -> None:
    """Initialise every parameter of a (possibly sharded) model from its `init_spec` (LoRA adapters:
    `lora.adapter_init_spec`), then its buffers; or module by module (`init_by_modules`) for a model
    with `init_module`, whose whole-tensor draws are skipped when every base weight is `loaded` next
    (its buffers and LoRA adapters are still initialised)."""
    if model.inits_by_module:
        init_by_modules(model, seed, parameters=not loaded)
        return
    for name, param in model.named_parameters():
        fqn = canonical_name(name)
        spec = adapter_init_spec(fqn, tuple(param.shape)) or model.init_spec(fqn)
        init_parameter(param, spec, fqn, seed)
    model.init_buffers()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor of `t`'s global shape and dtype, NaN-filled to show what stays unset."""
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    return out.fill_(float("nan")) if out.is_floating_point() else out


@torch.no_grad()
def _copy_slice(target: torch.Tensor, whole: torch.Tensor) -> None:
    """This rank's part of `whole` into `target` (a DTensor's local shard, or the tensor itself)."""
    if isinstance(target, DTensor):
        local = distribute_tensor(whole.to(target.device), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(whole.to(target.device))


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new object of the module's class sharing its attributes (no constructor runs: FSDP's module
    classes construct the original class in `__new__`)."""
    shadow = object.__new__(type(module))
    shadow.__dict__.update(module.__dict__)
    return shadow


@torch.no_grad()
def init_by_modules(model: nn.Module, seed: int, parameters: bool = True) -> None:
    """Initialise a (possibly sharded) model with its own module-level code, `model.init_module(module)`
    (module doc). Each module is handed to it as a shallow copy whose own parameters and buffers are
    whole host tensors; a parameter shared by several modules (tied embeddings) is initialised by the
    first. LoRA adapters start as `lora.adapter_init_spec` says. A floating-point parameter or buffer
    the model's code leaves unset is an error naming it. `parameters` False: the buffers only (and the
    adapters): the base weights are about to be loaded."""
    done: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        fqn = canonical_name(name)
        params = {k: p for k, p in module._parameters.items() if p is not None}
        adapters = {k: p for k, p in params.items() if adapter_init_spec(f"{fqn}.{k}", tuple(p.shape))}
        for k, p in adapters.items():
            init_parameter(p, adapter_init_spec(f"{fqn}.{k}", tuple(p.shape)), f"{fqn}.{k}", seed)
        params = {k: p for k, p in params.items() if k not in adapters} if parameters else {}
        buffers = {k: b for k, b in module._buffers.items() if b is not None}
        if not params and not buffers:
            continue
        shared = {k for k, p in params.items() if id(p) in done}  # initialised with an earlier module
        shadow = _shallow_copy(module)
        shadow._parameters = {k: None if p is None else done[id(p)].clone() if k in shared else
                              _whole(p) if k in params else torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
                              for k, p in module._parameters.items()}  # (meta: not initialised here)
        shadow._buffers = {k: None if b is None else _whole(b) for k, b in module._buffers.items()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_block_seed(seed, fqn or "<root>", 0))
            model.init_module(shadow)
        for kind, own, made in (("parameter", params, shadow._parameters), ("buffer", buffers, shadow._buffers)):
            for k, target in own.items():
                if kind == "parameter" and k in shared:
                    continue
                value = made[k]
                if value.is_floating_point() and torch.isnan(value).any():
                    raise ConfigError(f"[model] the model's own initialisation leaves {kind} {fqn}.{k} unset "
                                      f"(its code has no rule for {type(module).__name__}); it cannot train from "
                                      f"scratch: start from weights (checkpoint.initial_load_path)")
                _copy_slice(target if isinstance(target, DTensor) else target.data, value)
                if kind == "parameter":
                    done[id(target)] = value
