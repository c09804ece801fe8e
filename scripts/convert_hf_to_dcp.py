"""Import a Hugging Face model folder as a model-only torchtrain DCP checkpoint.

    python scripts/convert_hf_to_dcp.py hf_model out/checkpoint/step-0 [--dtype float32] \\
        [--job.config_file job.toml] [--model.flavor 8B ...]

The model is the one the job's `[model]` keys describe (checked against the folder's config.json).
The output loads under any layout: as `checkpoint.initial_load_path` (model only), or, named
`{checkpoint.folder}/step-0` of a job, as its seed checkpoint. One process, no GPU; the whole model
is held in CPU memory while writing (use `initial_load_in_hf` to stream HF weights into a sharded
run instead).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from torchtrain.components.checkpoint.folder import write_marker
from torchtrain.components.checkpoint.hf import hf_to_dcp
from torchtrain.components.checkpoint.startup import imported_context_length
from torchtrain.config import ConfigError, parse_args
from torchtrain.config.checkpoint import Checkpoint
from torchtrain.data.tokenizer import build_tokenizer
from torchtrain.distributed.layout import DTYPES
from torchtrain.models.registry import model_record
from torchtrain.trainer.preflight import resolve_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", help="Hugging Face model folder (config.json + *.safetensors)")
    parser.add_argument("out_dir", help="DCP checkpoint folder to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the model's (float32)")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = parse_args(overrides)
        spec, model_args = resolve_model(cfg, build_tokenizer(cfg.model.hf_assets_path))
        if spec.state_dict_adapter is None:
            raise ConfigError(f"model {spec.name!r} has no Hugging Face state-dict adapter")
        model_args.adopt_context_length(imported_context_length(
            Checkpoint(initial_load_path=args.hf_dir, initial_load_in_hf=True), spec.state_dict_adapter(model_args)))
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        summary = hf_to_dcp(args.hf_dir, args.out_dir, model, spec.state_dict_adapter(model_args),
                            DTYPES[args.dtype] if args.dtype else None, show_progress=True)
    except ConfigError as e:
        print(f"convert_hf_to_dcp: error: {e}", file=sys.stderr)
        return 2
    write_marker(args.out_dir, {
        "step": 0, "contents": ["model"], "model_only": True, "final": False, "tokens_seen": 0,
        "source": args.hf_dir, "dtype": args.dtype or "float32", "torch_version": torch.__version__,
        "model": model_record(cfg.model.name, cfg.model.flavor, model_args),
        "saved_at": datetime.datetime.now().isoformat(timespec="seconds"),
    })
    for warning in summary["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if summary["unused"]:
        print(f"warning: {len(summary['unused'])} HF tensors unused, e.g. {summary['unused'][:5]}", file=sys.stderr)
    print(f"wrote {args.out_dir}: {summary['tensors']} tensors (model-only DCP checkpoint)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
