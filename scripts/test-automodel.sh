#!/usr/bin/env bash
# NeMo-Automodel's own training loops on hsx's exports (tests/test_automodel_loop.py), in their own
# environment (.venv-automodel): Automodel 0.7 pins transformers==5.18.0, older than hsx admits, so hsx
# is not installed here; the test makes its runs and exports with the main environment's hsx
# (HSX_PYTHON, default .venv/bin/python: build it first) and trains with this one's python.
#   bash scripts/test-automodel.sh [install|test]   (no argument: both)
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # installed with --no-compile: bytecode is written on first import (scripts/test.sh)
step=${1:-all}
if [ "$step" != test ]; then
  python3 -m venv .venv-automodel
  .venv-automodel/bin/pip install -q --no-compile --upgrade pip
  # torch==2.13.0: any build works (CPU here); pinning it lets pip take a local CPU wheel where one exists.
  .venv-automodel/bin/pip install -q --no-compile "torch==2.13.0"
  # --no-deps: its metadata also declares quack-kernels, flashoptim, mistral-common and more, which
  # neither recipe imports. What train_eagle3 and train_dspark import, as tested: of its declared
  # dependencies transformers (its pin), torchao, megatron-fsdp, datasets, torchdata and pyyaml;
  # undeclared, pillow (its dataset package) and requests (its remote-target client).
  .venv-automodel/bin/pip install -q --no-compile --no-deps "nemo_automodel==0.7.0"
  .venv-automodel/bin/pip install -q --no-compile "torch==2.13.0" "transformers==5.18.0" "torchao==0.18.0" "megatron-fsdp==0.5.0" \
    "datasets==5.1.0" "torchdata==0.11.0" "pyyaml==6.0.4" "pillow==13.0.0" "requests==2.34.2" "pytest==9.2.0"
fi
if [ "$step" != install ]; then
  # --noconftest: tests/conftest.py imports hsx, which this environment does not hold.
  HSX_REQUIRE=automodel_loop HSX_PYTHON="${HSX_PYTHON:-$PWD/.venv/bin/python}" \
    .venv-automodel/bin/python -m pytest -q -p no:cacheprovider --noconftest tests/test_automodel_loop.py
fi
