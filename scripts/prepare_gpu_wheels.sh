#!/usr/bin/env bash
# Downloads, here, the wheels that `python -m bench.gpu_check` needs on a GPU machine without
# network, into one folder that travels with the repository (docs/calm.md, "The GPU check").
#
# The GPU machines have Python 3.12, torch 2.11 (CUDA 13), transformers 5.17 with its own
# dependencies (tokenizers, huggingface_hub, pyyaml, tqdm, regex, packaging, ...), peft,
# accelerate, safetensors, numpy and pytest. What the check imports beyond that (traced with
# an import log of a full CPU run): matplotlib, for the training curves and reliability
# diagrams every run writes, and matplotlib's own dependencies. All are pinned to the
# versions this project's environment runs; kiwisolver, pillow, fonttools and contourpy are
# compiled (cp312 manylinux wheels), the rest pure Python (py3-none-any).
#
# Usage: scripts/prepare_gpu_wheels.sh [FOLDER]      (default: .whl in the repository root)
# There: python -m pip install --no-index --no-deps FOLDER/*.whl
set -euo pipefail
DEST="${1:-.whl}"
PY="${PYTHON:-python3}"
WHEELS=(
  matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.69.1 kiwisolver==1.5.1
  pillow==13.0.0 pyparsing==3.3.3 python-dateutil==2.9.0.post0 six==1.17.0
)
mkdir -p "$DEST"
# --no-deps: numpy and packaging are there already; each name above is one wheel.
# Two platform tags: torch 2.11's wheels already need glibc 2.28 there, so manylinux_2_28
# wheels install wherever the check can run; manylinux2014 covers packages that ship only it.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
ls -1 "$DEST"
du -sh "$DEST"
echo "on the GPU machine: python -m pip install --no-index --no-deps $DEST/*.whl"
