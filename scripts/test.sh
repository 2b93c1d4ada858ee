#!/usr/bin/env bash
# Install hsx with its test dependencies into .venv, lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch==2.13.0: any build works; pinning it lets pip take a local CPU wheel where one exists.
.venv/bin/pip install -q "torch==2.13.0" -e ".[test]"
.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
.venv/bin/python -m pytest -q "$@"
