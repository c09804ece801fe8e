"""Export a torchtrain DCP checkpoint to a Hugging Face model folder (config.json + safetensors).

    python scripts/convert_dcp_to_hf.py outputs/job/checkpoint/step-1000 hf_out [--dtype bfloat16] \\
        [--max_shard_bytes 5368709120] [--model.name llama3 --model.flavor 8B ...]

CHECKPOINT is a `step-N` folder or a checkpoint folder (its newest complete step is used). The model
is described by the checkpoint's `complete.json` (written by torchtrain); for a DCP folder without
one, pass the `--model.*` keys of the job that saved it. Runs on one process, without a GPU, reading
one safetensors shard's worth of tensors at a time; any training layout's checkpoint works.
"""

from __future__ import annotations

import argparse
import sys

import torch

from torchtrain.components.checkpoint.hf import export_dcp_to_hf
from torchtrain.components.checkpoint.startup import resolve_dcp_path
from torchtrain.config import ConfigError, parse_args
from torchtrain.distributed.layout import DTYPES
from torchtrain.models.registry import build_model_args, get_model_spec, model_from_record


def model_from(meta: dict, overrides: list[str]):
    if meta.get("model") and not overrides:
        return model_from_record(meta["model"])
    if not overrides:
        raise ConfigError("the checkpoint has no complete.json describing the model; pass its --model.* keys "
                          "(e.g. --model.flavor 8B)")
    cfg = parse_args(overrides)
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor, cfg.model.overrides, cfg.model.override_sources)
    if getattr(args, "max_seq_len", 1) == 0:
        args.max_seq_len = cfg.training.seq_len
    return spec, args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="step-N folder (or a checkpoint folder: its newest complete step)")
    parser.add_argument("out_dir", help="Hugging Face folder to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as stored")
    parser.add_argument("--max_shard_bytes", type=int, default=5 * 1024**3)
    args, overrides = parser.parse_known_args(argv)
    try:
        path, meta = resolve_dcp_path(args.checkpoint)
        spec, model_args = model_from(meta, overrides)
        if spec.state_dict_adapter is None:
            raise ConfigError(f"model {spec.name!r} has no Hugging Face state-dict adapter")
        dtype = DTYPES[args.dtype] if args.dtype else None
        summary = export_dcp_to_hf(path, args.out_dir, spec.state_dict_adapter(model_args), dtype,
                                   args.max_shard_bytes, label=path, show_progress=True)
    except ConfigError as e:
        print(f"convert_dcp_to_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}: {summary['tensors']} tensors in {summary['files']} safetensors file(s), "
          f"{summary['bytes'] / 1e6:.1f} MB (from {path}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
