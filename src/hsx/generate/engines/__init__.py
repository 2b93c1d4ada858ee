"""Which engine a generate run uses, opened by name: ``open_engine(name, settings)``.

Each backend lives in its own module beside this one and exposes ``open(settings) -> Engine`` and
``capabilities(settings) -> Capabilities`` (what it does itself: the stage reads it, before the engine
is open and after, instead of asking which engine it is); the contract is ``base``. The table below
names the module, so an optional engine (vLLM, an HTTP client) is imported only
when a run uses it, and a build without it refuses by name instead of failing at import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.errors import OptionError, Refused
from hsx.generate.engines.base import Capabilities, Engine

# backend name -> module whose ``open(settings)`` returns the engine
ENGINES = {
    "transformers": "hsx.generate.engines.transformers",
    "vllm": "hsx.generate.engines.vllm",
    "server": "hsx.generate.engines.server",
}


@dataclass(frozen=True)
class EngineSettings:
    """What opening an engine needs. The common fields come from the run spec; the rest are how
    this session reaches its engine and are not part of the spec (they do not change the tokens:
    a resume may use other servers, or another parallel layout of vLLM, as the operator chooses)."""

    model_dir: Path
    tokenizer: Any = None  # the job's, loaded once (an engine that needs one uses it; None: it loads its own)
    trust_remote_code: bool = False
    dtype: str = "auto"  # torch dtype name or auto (the checkpoint's)
    device: str | None = None  # transformers: cpu, cuda, cuda:1 (None: cuda if present)
    threads: int | None = None  # transformers on CPU: torch's threads (None: torch's own choice)
    seed: int = 0  # the run's seed (each request carries its own, derived from it)
    max_length: int | None = None  # prompt + completion of a turn at most (vllm: its max_model_len)
    stop_ids: frozenset[int] = frozenset()  # the tokens that end a turn, as the job reads them (prompts.stop_ids)
    tensor_parallel_size: int = 1  # vllm
    servers: tuple[str, ...] = ()  # server: OpenAI-compatible base URLs
    concurrency: int = 64  # server: requests in flight per server
    max_pending: int | None = None  # requests kept submitted (None: the engine's own choice)
    extra: dict[str, str] = field(default_factory=dict)  # backend-specific knobs, by name, as given
    log: Callable[[str], None] | None = None  # where an engine reports what it goes on through (retries, outages)


def _module(name: str):
    """The module of engine ``name``; refused by name when unknown or not installed."""
    module_name = ENGINES.get(name)
    if module_name is None:
        raise OptionError(f"--backend takes {', '.join(ENGINES)}, not {name!r}")
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise Refused(f"the {name} generate backend is not available here ({e})") from e


def capabilities(name: str, settings: EngineSettings) -> Capabilities:
    """What engine ``name`` will do itself with ``settings``, before it is open."""
    return _module(name).capabilities(settings)


def open_engine(name: str, settings: EngineSettings) -> Engine:
    """The engine ``name`` opened with ``settings``; refused by name when unknown or not installed."""
    return _module(name).open(settings)
