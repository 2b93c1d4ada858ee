"""Shared test helpers: the bundled tiny model, small conversation files, running hsx for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.tinymodel import bundled_path

TINY = bundled_path("tiny-llama")
SHAREGPT = bundled_path("data/sharegpt_dummy_conversation.json")


def conversations(n: int, start: int = 0) -> list[dict]:
    return json.loads(SHAREGPT.read_text())[start : start + n]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def tiny_model() -> Path:
    return TINY


@pytest.fixture
def convs(tmp_path: Path) -> Path:
    """40 real multi-turn conversations as JSONL."""
    return write_jsonl(tmp_path / "convs.jsonl", conversations(40))


def hsx(*args: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run the real command line in a subprocess."""
    env = os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "hsx", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, **kw
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"hsx {' '.join(map(str, args))} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_files(out: Path) -> dict[str, bytes]:
    """Every sample file of a run, by path relative to its shards folder, with its bytes."""
    root = out / "shards"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.safetensors"))}
