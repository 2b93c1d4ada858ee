#!/usr/bin/env bash
# The Mooncake data plane's tests, in their own environment (.venv-mooncake): the store's client is a
# binary wheel that links rdma-core's libibverbs even for its TCP transport. The three Debian libraries
# it needs are unpacked beside the environment (no root, nothing installed system-wide).
#   bash scripts/test-mooncake.sh [install|test]   (no argument: both)
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # installed with --no-compile: bytecode is written on first import (scripts/test.sh)
step=${1:-all}
libs=.venv-mooncake/libs
if [ "$step" != test ]; then
  python3 -m venv .venv-mooncake
  .venv-mooncake/bin/pip install -q --no-compile --upgrade pip
  .venv-mooncake/bin/pip install -q --no-compile "torch==2.13.0" "mooncake-transfer-engine-non-cuda==0.3.13.post1" -e ".[test]"
  rm -rf "$libs" && mkdir -p "$libs/debs"
  debs=(libibverbs1 libnl-3-200 libnl-route-3-200)
  (cd "$libs/debs" && { apt-get download "${debs[@]}" || { apt-get update -q && apt-get download "${debs[@]}"; }; })
  for deb in "$libs"/debs/*.deb; do dpkg -x "$deb" "$libs"; done
fi
if [ "$step" != install ]; then
  export LD_LIBRARY_PATH="$PWD/$libs/usr/lib/x86_64-linux-gnu:$PWD/$libs/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export HSX_REQUIRE=mooncake PATH="$PWD/.venv-mooncake/bin:$PATH"
  .venv-mooncake/bin/python -m pytest -q tests/test_plane.py
fi
