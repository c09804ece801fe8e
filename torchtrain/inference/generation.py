"""Sample text from a trained model, to see what it learned (one process, CPU or GPU).

    python -m torchtrain.generate --checkpoint outputs/debug_model/checkpoint --prompt "def main(" \\
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] \\
        [--num-samples 1] [--device auto] [--dtype auto] [--config JOB.toml] [--section.key value ...]

`--checkpoint` is a torchtrain DCP checkpoint -- a job's dump folder, its checkpoint folder (the newest
complete step) or one `step-N` folder, saved under any layout (FSDP, TP, PP...: DCP stores global
shapes, read here into one unsharded model) -- or a Hugging Face folder (config.json + *.safetensors,
e.g. a `step-N/hf` export). The model and tokenizer are the job's: `--config` and overrides, else the
`job_config.toml` the trainer saved above the checkpoint, else (a DCP checkpoint) the model recorded
in its `complete.json` with the built-in tokenizer. For a Hugging Face folder without
`model.hf_assets_path`, its own tokenizer.json is used when it has one.

A model with a key/value cache (`BaseModel.takes_cache`: the decoder families but latent attention) runs the
prompt once and then one token a step (`posttrain/decoding.py::sample`, the sampler GRPO uses) while the prompt and
the new tokens fit in its `max_seq_len`. Past that, with images, or without a cache, each new token runs the model
over the whole context (at most the `max_seq_len` last tokens). Both draw the same random numbers, so a seed gives
the same text either way up to float summation order (cached keys are read through another kernel). Plenty to
inspect a model; no serving engine.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch

from torchtrain.config import ConfigError
from torchtrain.posttrain.decoding import Sampling, sample, sample_next

JOB_CONFIG = "job_config.toml"


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, s: Sampling, num_samples: int = 1,
             seed: int = 0, eos_id: int | None = None, vocab_limit: int | None = None,
             max_seq_len: int | None = None, progress=None, images: dict[str, torch.Tensor] | None = None
             ) -> list[list[int]]:
    """`num_samples` continuations of `prompt` (token ids), each at most `max_new_tokens` long and
    ending before the first `eos_id`. Only ids < `vocab_limit` are sampled (the tokenizer's). `images`: the
    prompt's images as one batch row (`pixel_values` (1, P, C T p p), `image_grid` (1, I, 3)), given to a
    vision-language model at every step; the context is then never cut (its placeholders must stay whole)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    if max_new_tokens > 0 and not images and model.takes_cache and (max_seq_len is None or len(prompt) + max_new_tokens <= max_seq_len):
        got = sample(model, [list(prompt)] * num_samples, max_new_tokens, s, generator,
                     () if eos_id is None else (eos_id,), vocab_limit, progress=progress)
        return [row[:-1] if stopped else row for row, stopped in zip(got.tokens, got.stopped)]
    tokens = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)
    done = torch.zeros(num_samples, dtype=torch.bool, device=device)
    kwargs = {k: v.to(device).expand(num_samples, *v.shape[1:]) for k, v in (images or {}).items()}
    if kwargs:
        max_new_tokens = min(max_new_tokens, room_for(len(prompt), max_seq_len))
    for _ in range(max_new_tokens):
        context = tokens if max_seq_len is None or kwargs else tokens[:, -max_seq_len:]
        logits = model(context, **kwargs)[:, -1, :]
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = -float("inf")
        nxt = sample_next(logits, s, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if progress is not None:
            progress.update(num_samples)
        if bool(done.all()):
            break
    out = []
    for row in tokens[:, len(prompt):].tolist():
        out.append(row[:row.index(eos_id)] if eos_id is not None and eos_id in row else row)
    return out


def room_for(prompt_tokens: int, max_seq_len: int | None) -> int:
    """How many tokens fit after a prompt of `prompt_tokens` that is never cut (one with images: its placeholders
    stay whole) in a model of `max_seq_len` positions (None: no limit); ConfigError when none do."""
    if max_seq_len is None:
        return sys.maxsize
    if prompt_tokens >= max_seq_len:
        raise ConfigError(f"the prompt with its images ({prompt_tokens} tokens) fills the model's max_seq_len "
                          f"{max_seq_len}: no room for an answer; use fewer or smaller images or a shorter prompt")
    return max_seq_len - prompt_tokens


# ------------------------------------------------------------------------------------- loading
def _is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path))


def find_job_config(path: str, levels: int = 4) -> str | None:
    """The trainer's saved job_config.toml in `path` or one of its parents (dump/checkpoint/step-N/hf)."""
    folder = os.path.abspath(path)
    for _ in range(levels + 1):
        candidate = os.path.join(folder, JOB_CONFIG)
        if os.path.isfile(candidate):
            return candidate
        folder = os.path.dirname(folder)
    return None


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    args: object
    source: str
    """What was loaded, for the log line."""
    image_spec: object = None
    """How images become patches and tokens (`data/image/pixels.py::ImageSpec`) for a model that sees them."""

    def prompt_with_images(self, paths: list[str], text: str, chat: bool) -> tuple[list[int], dict]:
        """The prompt's ids -- the images first, then `text`; rendered with the chat template when `chat` -- and
        the images as one batch row (`pixel_values`, `image_grid`)."""
        from torchtrain.data.chat.records import Conversation
        from torchtrain.data.image.image_chat import expand
        from torchtrain.data.image.pixels import open_image

        spec, tok = self.image_spec, self.tokenizer
        if spec is None:
            raise ConfigError("--image: this model has no vision encoder")
        pixels, grids = [], []
        for path in paths:
            try:
                patches, grid = spec.patches(open_image(path))
            except ValueError as e:
                raise ConfigError(f"--image {path}: {e}") from None
            pixels.append(patches)
            grids.append(grid)
        if chat:
            from torchtrain.data.chat.template import chat_renderer

            parts = tuple(("image", p) for p in paths) + ((("text", text),) if text else ())
            ids = chat_renderer(tok).generation_prompt(Conversation((("user", parts),), "--prompt"))
            ids, _, _ = expand(ids, [False] * len(ids), grids, spec, "--prompt")
        else:
            ids = ([tok.bos_id] if tok.bos_id is not None else []) + [t for g in grids for t in spec.tokens(g)]
            ids += tok.encode(text, bos=False, eos=False)
        images = {"pixel_values": torch.cat(pixels).unsqueeze(0),
                  "image_grid": torch.tensor(grids, dtype=torch.long).unsqueeze(0)}
        return ids, images


def load(checkpoint: str, config: str | None, overrides: list[str], device: torch.device,
         dtype: torch.dtype) -> Loaded:
    """The job's model with the checkpoint's weights, in eval mode, and the job's tokenizer."""
    from torchtrain.components.checkpoint.startup import resolve_dcp_path
    from torchtrain.config import parse_args
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.posttrain.sampling_layout import build_whole
    from torchtrain.trainer.preflight import image_spec_for, resolve_model

    if not os.path.exists(checkpoint):
        raise ConfigError(f"--checkpoint {checkpoint} does not exist")
    config = config or find_job_config(checkpoint)
    cfg = parse_args((["--job.config_file", config] if config else []) + overrides)
    path = checkpoint
    if config and os.path.dirname(os.path.abspath(config)) == os.path.abspath(path):  # a dump folder
        path = os.path.join(path, cfg.checkpoint.folder)
    hf = _is_hf_folder(path)
    meta: dict = {}
    if not hf:
        path, meta = resolve_dcp_path(path)
    # no job at hand (a checkpoint copied away from its job folder): the model and tokenizer it recorded
    recorded = (not config and meta.get("model") and not cfg.model.overrides
                and not any(a.startswith(("--model.name", "--model.flavor")) for a in overrides))
    assets = cfg.model.hf_assets_path
    if recorded and not assets and meta.get("tokenizer"):
        assets = meta["tokenizer"]
        if not os.path.exists(assets):
            raise ConfigError(f"--checkpoint {checkpoint} was trained with the tokenizer at {assets}, which is not "
                              f"there; pass --model.hf_assets_path with that tokenizer's folder")
    if hf and not assets and os.path.exists(os.path.join(path, "tokenizer.json")):
        assets = path
    tokenizer = build_tokenizer(assets)
    if recorded:
        from torchtrain.models.registry import model_from_record

        spec, args = model_from_record(meta["model"])
    else:
        spec, args = resolve_model(cfg, tokenizer)
    image_spec = image_spec_for(cfg, args, tokenizer) if args.image_geometry() is not None else None
    # a LoRA run's checkpoint holds the adapters beside the base weights
    model = build_whole(spec, args, device, cfg.lora if cfg.lora.enable and not hf else None)
    if hf:
        _load_hf(model, spec, args, path)
    else:
        if meta.get("adapter_only"):
            _load_base(model, spec, args, cfg, path)
        _load_dcp(model, path)
    for p in model.parameters():  # parameters only: buffers (the RoPE table) keep their float32
        p.data = p.data.to(dtype)
    where = f"job {config}" if config else ("overrides" if overrides else "the checkpoint's complete.json")
    return Loaded(model.eval(), tokenizer, args, f"{'HF' if hf else 'DCP'} {path} (model from {where})", image_spec)


def _load_base(model: torch.nn.Module, spec, args, cfg, path: str) -> None:
    """The base weights under an adapter-only checkpoint (`lora.save_adapter_only`): the job's
    `checkpoint.initial_load_path`, as the run loaded them."""
    from torchtrain.components.checkpoint.startup import resolve_dcp_path

    base = cfg.checkpoint.initial_load_path
    if not base:
        raise ConfigError(f"[checkpoint.initial_load_path] --checkpoint {path} holds LoRA adapters only "
                          f"(lora.save_adapter_only): set checkpoint.initial_load_path to the base weights it was "
                          f"trained on")
    if cfg.checkpoint.initial_load_in_hf:
        _load_hf(model, spec, args, base)
    else:
        _load_dcp(model, resolve_dcp_path(base)[0])


def _load_dcp(model: torch.nn.Module, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from torchtrain.components.checkpoint.validate import CheckpointError, check_against_metadata, read_metadata
    from torchtrain.models.converters.lora import lora_load_keys

    metadata = read_metadata(path, "checkpoint")
    stored = {k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")}
    state = {"model": lora_load_keys(model.state_dict(), stored)}  # a LoRA model: what the checkpoint holds
    problem = check_against_metadata(metadata, state, path, "checkpoint")
    if problem:
        raise CheckpointError(problem)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)  # in place, each tensor at its global shape


def _load_hf(model: torch.nn.Module, spec, args, path: str) -> None:
    from torchtrain.components.checkpoint.hf import load_hf_into_model
    from torchtrain.components.checkpoint.state import ModelState

    if spec.state_dict_adapter is None:
        raise ConfigError(f"model {spec.name!r} has no Hugging Face state-dict adapter; use a DCP checkpoint")
    from torchtrain.models.converters.lora import is_adapter_param, lora_adapter_class

    adapter = spec.state_dict_adapter
    if any(is_adapter_param(k) for k in model.state_dict()):  # a LoRA model: the base weights only
        adapter = lora_adapter_class(adapter)
    warnings, _, _ = load_hf_into_model(ModelState([model]), path, adapter(args))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


# ------------------------------------------------------------------------------------------ CLI
