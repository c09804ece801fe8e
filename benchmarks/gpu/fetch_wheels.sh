#!/usr/bin/env bash
# Download the wheels the GPU evidence kit needs on the GPU machine (Python 3.12, x86_64, torch 2.11
# already there, no network there) into .whl/ at the repository root (ignored by .gitignore, kept out of
# git); the GPU commands carry it (benchmarks/gpu/README.md). Run once, on a machine with PyPI access.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# .whl/ is in .gitignore: it travels to the GPU machine only when a command names it in `carry`.
rm -rf .whl && mkdir -p .whl
# torchtrain: torchdata. Float8: torchao (0.18 needs torch >= 2.11 for its kernels: the image has 2.11).
# torchtitan 0.2.2 and what it needs beyond the image (datasets and its dill/multiprocess; tyro and its
# docstring-parser/typeguard/shtab). Everything else (tokenizers, pyarrow, pandas, tensorboard, ...) is
# already installed on the GPU machine.
PKGS=(torchdata==0.11.0 torchao==0.18.0 torchtitan==0.2.2 datasets==4.4.1 dill==0.4.0 multiprocess==0.70.18
      tyro==0.9.35 docstring-parser==0.17.0 typeguard==4.4.4 shtab==1.7.2 tomli==2.3.0)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform any -d .whl "${PKGS[@]}"
ls -la .whl
du -sh .whl
