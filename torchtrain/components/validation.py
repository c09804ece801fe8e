"""Validation: the loss of the current weights on held-out data ([validation], docs/validation.md).

Every `freq` steps the trainer evaluates `steps` batches of the validation split (or all of it),
always the same batches from the start of the split, with the model in eval mode and no gradients:

    validation_loss       = (sum over all ranks, batches, target tokens of CE) / (number of those tokens)
    validation_perplexity = exp(validation_loss)

a global token mean like the training loss, but not scaled for gradient accumulation (there is no
backward): each rank sums its cross-entropy in float32 per batch, the sums and token counts are
accumulated in float64, all-reduced over data-parallel ranks (and pipeline stages, where only the
last stage holds a loss) and divided once. Windows are dealt round-robin over data-parallel ranks
like training data, so a validation batch over all ranks is exactly what one process with a dp
times larger batch reads, and the value does not depend on the layout.

Pipeline parallelism: the stages' forward is run directly, stage by stage in stage order, over the
whole validation batch, sending each stage's output to the rank of the next stage (a shape/dtype
header, then the tensor, over the pipeline process group). Unlike the training schedule's
forward-only mode (`schedule.eval()`, torch >= 2.9) this works with every schedule and placement
on torch 2.11 and later, accepts any validation batch and sequence length (the schedule's buffers
are sized for the training micro-batches), and leaves the training schedule's state untouched.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from torchtrain.components.data import build_source
from torchtrain.components.data.dataset import PackedDataset
from torchtrain.components.data.sources import DocumentSource
from torchtrain.components.loss import count_valid_tokens, cross_entropy_sum, local_value
from torchtrain.config import ConfigError, JobConfig
from torchtrain.distributed.tensor_parallel import check_divisible
from torchtrain.distributed.utils import all_reduce
from torchtrain.utils.logging import logger

_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # dtype code, ndim, up to 6 dimensions


def resolved_shape(cfg: JobConfig) -> tuple[int, int]:
    """(local batch size, sequence length) of validation batches, -1 resolved from [training]."""
    v = cfg.validation
    return (v.local_batch_size if v.local_batch_size > 0 else cfg.training.local_batch_size,
            v.seq_len if v.seq_len > 0 else cfg.training.seq_len)


def check_validation_layout(cfg: JobConfig, parallel_dims) -> None:
    """Layout checks (before start-up): sequence parallelism splits validation sequences too."""
    if not cfg.validation.enable:
        return
    _, seq_len = resolved_shape(cfg)
    check_divisible(parallel_dims.tp, {"validation.seq_len": seq_len},
                    {"validation.seq_len": "sequence parallelism splits every validation sequence evenly"})


def build_validation_source(cfg: JobConfig) -> DocumentSource | None:
    """The held-out documents (None when validation is off); ConfigError when they cannot be read."""
    v = cfg.validation
    if not v.enable:
        return None
    name = v.dataset or cfg.training.dataset
    path = v.dataset_path
    if name == "files" and path == cfg.training.dataset_path:
        logger.warning("validation.dataset_path is the training data: the validation loss is not held out")
    try:
        return build_source(name, path, "validation", cfg.debug.seed)
    except ConfigError as e:
        raise ConfigError(str(e).replace("[training.", "[validation.")) from None


class Validator:
    """Evaluates the trainer's model parts on the validation split (see the module docstring)."""

    def __init__(self, trainer, source: DocumentSource):
        cfg = trainer.job_config
        self.trainer, self.cfg = trainer, cfg.validation
        self.local_batch_size, self.seq_len = resolved_shape(cfg)
        pd = trainer.parallel_dims
        self.dataset = PackedDataset(source, trainer.tokenizer, self.seq_len, dp_rank=pd.dp_rank, dp_degree=pd.dp,
                                     seed=cfg.debug.seed, shuffle=False, infinite=False)
        limit = "the whole split" if self.cfg.steps == -1 else f"{self.cfg.steps} batches"
        logger.info("validation every %d steps: %s of %d x %d sequences of %d tokens (%s)", self.cfg.freq, limit,
                    self.local_batch_size, pd.dp, self.seq_len, self.cfg.dataset or cfg.training.dataset)

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0

    def batches(self):
        """The validation batches of this rank, from the start of the split."""
        self.dataset.load_state_dict({"epoch": 0, "doc": 0, "offset": 0, "windows": 0})
        loader = DataLoader(self.dataset, batch_size=self.local_batch_size, num_workers=0, drop_last=True)
        for i, batch in enumerate(loader):
            if self.cfg.steps != -1 and i >= self.cfg.steps:
                return
            yield batch

    @torch.no_grad()
    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        trainer = self.trainer
        pd, device = trainer.parallel_dims, trainer.device
        for part in trainer.model_parts:
            part.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # CE sum, target tokens
        n = 0
        try:
            for inputs, labels in self.batches():
                n += 1
                with trainer.train_context():
                    logits = self._forward(inputs)
                    if logits is not None:
                        labels = labels.to(device)
                        totals[0] += local_value(cross_entropy_sum(logits, labels)).double()
                        totals[1] += count_valid_tokens(labels)
                del logits
        finally:
            for part in trainer.model_parts:
                part.train()
        if n == 0:
            raise ConfigError(f"[validation] the validation split holds less than one batch ({self.local_batch_size} x "
                              f"{pd.dp} sequences of {self.seq_len + 1} tokens); use a larger split or smaller "
                              f"validation.local_batch_size / seq_len")
        all_reduce(totals, pd.dp_mesh)
        if pd.pp_enabled:
            all_reduce(totals, pd.pp_mesh)
        ce_sum, tokens = totals.tolist()
        loss = ce_sum / tokens
        out = {"validation_loss": loss, "validation_perplexity": math.exp(min(loss, 700.0)),
               "validation_tokens": int(tokens), "validation_batches": n}
        logger.info("step %5d | validation loss %.4f | perplexity %.3f | %d tokens in %d batches | %.2fs", step, loss,
                    out["validation_perplexity"], int(tokens), n, time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------------ forward
    def _forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Logits of the batch; under pipeline parallelism only on the rank of the last stage (else None)."""
        trainer = self.trainer
        inputs = inputs.to(trainer.device)
        if trainer.pp_plan is None:
            return trainer.model_parts[0](inputs)
        return self._pipeline_forward(inputs)

    def _pipeline_forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        trainer = self.trainer
        plan, pd = trainer.pp_plan, trainer.parallel_dims
        group = pd.pp_mesh.get_group()
        mine = dict(zip(plan.stage_ids(pd.pp_rank, pd.pp), trainer.model_parts))
        owner = {s: r for r in range(pd.pp) for s in plan.stage_ids(r, pd.pp)}
        h = None
        for s in range(plan.num_stages):
            if s not in mine:
                continue
            if s == 0:
                x = inputs
            elif owner[s - 1] == pd.pp_rank:
                x = h
            else:
                x = _recv(dist.get_global_rank(group, owner[s - 1]), group, trainer.device)
            h = mine[s](x)
            if s + 1 < plan.num_stages and owner[s + 1] != pd.pp_rank:
                _send(h, dist.get_global_rank(group, owner[s + 1]), group)
        return h if plan.num_stages - 1 in mine else None


def _send(t: torch.Tensor, dst: int, group) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):  # stage outputs are local tensors under TP (use_local_output)
        t = t.to_local()
    t = t.contiguous()
    if t.dim() > _HEADER - 2:
        raise ValueError(f"stage output has {t.dim()} dimensions; at most {_HEADER - 2} can be sent")
    header = [_WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER - 2 - t.dim())
    dist.send(torch.tensor(header, dtype=torch.int64, device=t.device), dst, group=group)
    dist.send(t, dst, group=group)


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    code, ndim, *dims = header.tolist()
    out = torch.empty(dims[:ndim], dtype=_WIRE_DTYPES[code], device=device)
    dist.recv(out, src, group=group)
    return out
