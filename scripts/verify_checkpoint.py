"""Check DCP checkpoints offline, without loading them: their files against the hashes written with them,
and their pickles for anything that could run code.

    python scripts/verify_checkpoint.py FOLDER [FOLDER ...]

FOLDER is a DCP folder (with `.metadata`: a `step-N`, a torchtitan or any other DCP checkpoint) or a
checkpoint folder, whose every `step-N` holding a `.metadata` is checked:

* a torchtrain checkpoint's files are hashed and compared with the CRC-32 hashes of its `complete.json`
  (torchtrain/components/checkpoint/integrity.py): a flipped byte, a truncated, missing or replaced
  file is one `corrupt:` line naming the file. A checkpoint written before torchtrain hashed its files,
  or a folder without `complete.json` (an interrupted save, another program's checkpoint), is said so;
* every pickle (the metadata and each byte entry) is read by the restricted unpickler the trainer, the
  converters and `torchtrain.generate` use before loading (safety.py): the report names what each
  folder's pickles import; a refused folder is one line naming the file and the class.

Exit status 0 when every folder passes, 1 when one is corrupt or refused, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtrain.components.checkpoint import folder as fs
from torchtrain.components.checkpoint import integrity
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
    bad = 0
    for given in args.folders:
        try:
            for path in dcp_folders(given):
                meta, problem = fs.read_marker(path)
                files = (meta or {}).get("files")
                if files:
                    corrupt = integrity.verify(path, files, sorted(files))
                    if corrupt:
                        print(f"corrupt: {path}: {corrupt}", file=sys.stderr)
                        bad += 1
                        continue
                    hashes = f"; {len(files)} files match their {meta.get('hash')} hashes"
                elif meta:
                    hashes = "; no file hashes (written before torchtrain hashed its files): not verified"
                else:
                    hashes = f"; {problem}: not a complete torchtrain checkpoint"
                report = scan(path, "verify_checkpoint")
                print(f"ok: {report.describe()}{hashes}")
        except CheckpointError as e:
            print(f"refused: {e}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
