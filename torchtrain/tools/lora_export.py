"""Export a LoRA run: a merged Hugging Face checkpoint, or a PEFT adapter folder.

    python -m torchtrain.tools.lora_export CHECKPOINT OUT --format merged|peft [--base NAME] --job.config_file F [...]

CHECKPOINT is a `step-N` folder or a checkpoint folder (its newest complete step); the model is the one the
checkpoint recorded (family, flavor and arguments, as the run was given them), and the job's keys (the job
file that trained it, with its [lora] section) describe the adapters (and the model, for a checkpoint without a
record).

* `merged`: config.json + model.safetensors, each adapted weight replaced by W + (alpha/r) B A: an
  ordinary Hugging Face model.
* `peft`: adapter_config.json + adapter_model.safetensors as PEFT writes them (keys
  `base_model.model.<HF module>.lora_A.weight` / `.lora_B.weight`, `target_modules` the adapted HF
  modules by full name), which `peft.PeftModel.from_pretrained(base, OUT)` loads onto the base model.
  `--base` goes into `base_model_name_or_path`.

The whole model is read into host memory (fine for the models LoRA is used on one machine with; the
merged export writes one safetensors file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

from torchtrain.components.checkpoint.hf import write_config
from torchtrain.config.lora import Lora
from torchtrain.models.converters.lora import apply_lora, is_adapter_param, lora_load_keys
from torchtrain.models.state_dict_adapter import StateDictAdapter

A, B = ".lora_a.weight", ".lora_b.weight"


def adapted_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """torchtrain names of the adapted linear layers (`layers.0.attention.wq`)."""
    return [k[:-len(A)] for k in state if k.endswith(A)]


def merged_state(state: dict[str, torch.Tensor], cfg: Lora) -> dict[str, torch.Tensor]:
    """The model's state with every adapter folded into its base weight (float32 arithmetic)."""
    out = {k: v for k, v in state.items() if not is_adapter_param(k)}
    scale = cfg.alpha / cfg.rank
    for name in adapted_modules(state):
        w = out[f"{name}.weight"]
        delta = state[name + B].float() @ state[name + A].float()
        out[f"{name}.weight"] = (w.float() + scale * delta).to(w.dtype)
    return out


def _hf_module(adapter: StateDictAdapter, name: str) -> str:
    weight = adapter.hf_key(f"{name}.weight")
    return weight[:-len(".weight")]


def peft_adapter(state: dict[str, torch.Tensor], cfg: Lora, adapter: StateDictAdapter, base: str = ""
                 ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter_model.safetensors tensors) in PEFT's names and layouts."""
    tensors, modules = {}, []
    for name in adapted_modules(state):
        module = _hf_module(adapter, name)
        modules.append(module)
        tensors[f"base_model.model.{module}.lora_A.weight"] = state[name + A].contiguous()
        # B's rows are the base weight's output rows: HF's row order is the weight's (e.g. RoPE's pairs)
        tensors[f"base_model.model.{module}.lora_B.weight"] = adapter.to_hf(f"{name}.weight",
                                                                            state[name + B]).contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base or None,
              "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": modules,
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
              "modules_to_save": None, "init_lora_weights": True}
    return config, tensors


def write_peft(folder: str, state: dict[str, torch.Tensor], cfg: Lora, adapter: StateDictAdapter,
               base: str = "") -> None:
    config, tensors = peft_adapter(state, cfg, adapter, base)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})


def write_merged(folder: str, state: dict[str, torch.Tensor], cfg: Lora, adapter: StateDictAdapter) -> None:
    merged = merged_state(state, cfg)
    tensors = {k: v.contiguous() for k, v in adapter.to_hf_state(merged.items()).items()}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    write_config(folder, adapter, next(iter(tensors.values())).dtype)


def load_lora_state(checkpoint: str, job_argv: list[str]) -> tuple[dict[str, torch.Tensor], Lora, StateDictAdapter]:
    """The LoRA model's state from a DCP checkpoint of any layout (an adapter-only checkpoint,
    `lora.save_adapter_only`: the adapters only), its [lora] section and HF adapter."""
    import torch.distributed.checkpoint as dcp

    from torchtrain.components.checkpoint.startup import resolve_dcp_path
    from torchtrain.config import ConfigError, parse_args
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.models.registry import model_from_record
    from torchtrain.trainer.preflight import resolve_model

    cfg = parse_args(job_argv)
    if not cfg.lora.enable:
        raise ConfigError("[lora.enable] the job does not train LoRA adapters: pass the job file that trained "
                          "the checkpoint (lora.enable = true)")
    path, meta = resolve_dcp_path(checkpoint)
    # the model the checkpoint recorded (the job file's keys may not be all the run was given); else the job's
    spec, args = (model_from_record(meta["model"]) if meta.get("model")
                  else resolve_model(cfg, build_tokenizer(cfg.model.hf_assets_path)))
    if spec.state_dict_adapter is None:
        raise ConfigError(f"[model.name] {spec.name!r} has no Hugging Face names to export under")
    with torch.device("meta"):
        model = spec.build(args)
    apply_lora(model, cfg.lora)
    model.to_empty(device="cpu")
    stored = {k[len("model."):] for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
              if k.startswith("model.")}
    state = lora_load_keys(model.state_dict(), stored)
    dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    return state, cfg.lora, spec.state_dict_adapter(args)


def main(argv: list[str] | None = None) -> int:
    from torchtrain.config import ConfigError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--format", choices=("merged", "peft"), required=True)
    parser.add_argument("--base", default="", help="base_model_name_or_path recorded in a PEFT adapter")
    opts, job_argv = parser.parse_known_args(argv)
    try:
        state, cfg, adapter = load_lora_state(opts.checkpoint, job_argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if opts.format == "merged" and not any(not is_adapter_param(k) for k in state):
        print(f"error: [lora.save_adapter_only] {opts.checkpoint} holds the adapters only: export them with --format "
              f"peft (PEFT applies them to the base model), or merge from a checkpoint with the base weights",
              file=sys.stderr)
        return 2
    if opts.format == "peft":
        write_peft(opts.out, state, cfg, adapter, opts.base)
    else:
        write_merged(opts.out, state, cfg, adapter)
    print(f"wrote {opts.format} export of {len(adapted_modules(state))} adapted layers to {opts.out}")
    return 0


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
