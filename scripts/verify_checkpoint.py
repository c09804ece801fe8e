"""Check a DCP checkpoint folder for pickles that could run code, without loading it.

    python scripts/verify_checkpoint.py FOLDER [FOLDER ...]

FOLDER is a DCP folder (with `.metadata`: a `step-N`, a torchtitan or any other DCP checkpoint) or a
checkpoint folder, whose every `step-N` holding a `.metadata` is checked. Every pickle of it (the
metadata and each byte entry) is read by the restricted unpickler the trainer, the converters and
`torchtrain.generate` use before loading (torchtrain/components/checkpoint/safety.py): the report
names what each folder's pickles import; a refused folder is one line naming the file and the class.
Exit status 0 when every folder passes, 1 when one is refused, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtrain.components.checkpoint import folder as fs
from torchtrain.components.checkpoint.safety import METADATA, CheckpointError, scan


def dcp_folders(path: str) -> list[str]:
    """The DCP folders under `path`: itself, or its `step-N` sub-folders that hold a .metadata."""
    if os.path.exists(os.path.join(path, METADATA)):
        return [path]
    found = [c.path for c in fs.scan(path) if os.path.exists(os.path.join(c.path, METADATA))]
    if not found:
        raise CheckpointError(f"{path} is neither a DCP folder (no {METADATA}) nor a checkpoint folder with "
                              f"step-N folders")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", metavar="FOLDER")
    args = parser.parse_args(argv)
    refused = 0
    for given in args.folders:
        try:
            for path in dcp_folders(given):
                report = scan(path, "verify_checkpoint")
                print(f"ok: {report.describe()}")
        except CheckpointError as e:
            print(f"refused: {e}", file=sys.stderr)
            refused += 1
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
