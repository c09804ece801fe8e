"""Write a torchtrain checkpoint in torchtitan's DCP layout, to go back to torchtitan.

    python scripts/convert_to_torchtitan.py outputs/job/checkpoint/step-1000 tt_ckpt/step-1000 \\
        [--version 0.3] [--with-optimizer] [--model.name llama3 --model.flavor 8B ...]

CHECKPOINT is a `step-N` folder or a checkpoint folder (its newest complete step). The model is
described by the checkpoint's `complete.json`; for a DCP folder without one, pass the `--model.*`
keys of the job that saved it. The data files are hard-linked, not rewritten: instant at any size.
In torchtitan, point `checkpoint.initial_load_path` at OUT (weights), or with `--with-optimizer`
put it in the run's checkpoint folder to continue (optimizer and step; set
`checkpoint.exclude_from_loading = ["dataloader", "lr_scheduler"]`). The reverse direction needs no
script: a torchtitan checkpoint is a valid `checkpoint.initial_load_path` (docs/migrating_from_torchtitan.md).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from convert_dcp_to_hf import model_from  # noqa: E402

from torchtrain.components.checkpoint.startup import resolve_dcp_path  # noqa: E402
from torchtrain.components.checkpoint.torchtitan import write_torchtitan  # noqa: E402
from torchtrain.config import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="step-N folder (or a checkpoint folder: its newest complete step)")
    parser.add_argument("out_dir", help="folder to write (torchtitan's step-N)")
    parser.add_argument("--version", choices=["0.2", "0.3"], default="0.2",
                        help="torchtitan's parameter naming: 0.2.x (default) or 0.3.x (qkv_linear, lm_head)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="also the optimizer state and train_state (step, ntokens_seen)")
    args, overrides = parser.parse_known_args(argv)
    try:
        path, meta = resolve_dcp_path(args.checkpoint)
        spec, model_args = model_from(meta, overrides)
        if os.path.exists(os.path.join(args.out_dir, ".metadata")):
            raise ConfigError(f"{args.out_dir} already holds a checkpoint; choose an empty folder")
        adapter = spec.state_dict_adapter(model_args) if spec.state_dict_adapter is not None else None
        counts = write_torchtitan(path, args.out_dir, adapter, args.version, args.with_optimizer)
    except (ConfigError, OSError) as e:
        print(f"convert_to_torchtitan: error: {e}", file=sys.stderr)
        return 2
    parts = ", ".join(f"{n} {part} keys" for part, n in counts.items())
    print(f"wrote {args.out_dir}: torchtitan {args.version} checkpoint of {spec.name} ({parts}) from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
