#!/usr/bin/env bash
# Create .venv-sglang-loader for tests/sglang_load_weights.py: SGLang's own wheel and its own model/loader code,
# with the torch, torchvision and transformers it pins, plus only what importing that code needs.
#
# The wheel goes in with --no-deps: its full dependency list pulls GPU kernels (flashinfer, deep-gemm,
# tilelang, ...) that are useless here. This env loads checkpoints; it cannot serve (docs/architecture.md §6).
# torch 2.14.1 is the CUDA build from PyPI (~3.2 GB of nvidia wheels, ~6 GB venv): the CPU build of torch
# 2.13 was tried and fails, because SGLang's ServerArgs imports torchvision and PyPI only has CUDA-linked
# torchvision wheels, which cannot load against a +cpu torch.
#
# Usage: bash tests/make_sglang_env.sh [VENV]   (default .venv-sglang-loader; PYTHON picks the interpreter)
set -euo pipefail

VENV=${1:-.venv-sglang-loader}
PYTHON=${PYTHON:-python3}
SGLANG=sglang==0.5.23
# SGLang 0.5.23's own pins for these.
PINNED=(torch==2.14.1 torchvision==0.29.1 transformers==5.19.0 tokenizers==0.23.2)
# What `import sglang.srt.models.llama_eagle3` and SGLang's parallel-state setup import (found by importing).
IMPORTS=(orjson psutil pybase64 requests pillow starlette msgspec pyzmq ipython aiohttp
         apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 loguru gguf
         openai==2.8.0 partial-json-parser dill einops)

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" --no-deps "$SGLANG"
# pip then lists sglang's other requirements as missing: expected (GPU serving deps), so that list is kept
# out of the output; any other message, or a failure, is shown.
LOG="$VENV/pip-install.log"
"${PIP[@]}" "${PINNED[@]}" "${IMPORTS[@]}" >"$LOG" 2>&1 || { cat "$LOG"; exit 1; }
grep -v -e "^sglang .* requires" -e "dependency resolver" -e "is ignored: it is neither" "$LOG" || true
"$VENV/bin/python" -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$VENV/.eaglet-installed"
