"""The commands that need no run: ``bench`` and ``memory``."""

from __future__ import annotations

from collections.abc import Callable

from hsx.bench import BENCH, BenchOptions
from hsx.cli.options import command
from hsx.cli.output import failures, log
from hsx.extract.memory import MEMORY, MemoryOptions


def _bench(build: Callable[[], BenchOptions], given: dict) -> None:
    """Time forward-only, the naive baseline and hsx's extraction on the same batches, in one run."""
    from hsx.bench import run

    with failures():
        table = run(build(), log)
    print(table)


def _memory(build: Callable[[], MemoryOptions], given: dict) -> None:
    """Per-GPU memory of a parallel layout, from config.json and the safetensors headers (no weight read)."""
    from hsx.extract.memory import explain

    with failures():
        lines = explain(build())
    print(*lines, sep="\n")


bench = command(BenchOptions, BENCH, _bench)
memory = command(MemoryOptions, MEMORY, _memory)
