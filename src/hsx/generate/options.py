"""What the operator asked ``hsx generate`` for, parsed and range-checked once: ``GenerateOptions``.

``None`` means "not given": a new run takes ``DEFAULTS``, a resume takes the spec's value, and a
value given on a resume must equal the spec's (``spec.generate_differences``). Every range check
lives in ``GenerateOptions.__post_init__``, so a bad value is refused before anything is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hsx.errors import OptionError
from hsx.generate.engine import Sampling
from hsx.generate.engines import ENGINES, EngineSettings
from hsx.telemetry import Telemetry

DEFAULTS = {
    "backend": "transformers",
    "turns": "all",
    "samples_per_prompt": 1,
    "seed": 0,
    "max_length": 4096,
    "shard_size": 1000,
    "dtype": "auto",
}
DTYPES = ("auto", "bfloat16", "float16", "float32")
SAMPLING = Sampling()  # its defaults: greedy, 2048 new tokens at most


def _refuse(option: str, value: object, allowed: str) -> OptionError:
    return OptionError(f"--{option} {value!r} is out of range: {allowed}")


def template_kwargs(text: str | None) -> dict | None:
    """``--template-kwargs '{"enable_thinking": false}'``: a JSON object, or a refusal naming the option."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"--template-kwargs must be a JSON object, not {text!r} ({e.msg})") from e
    if not isinstance(value, dict):
        raise OptionError(f"--template-kwargs must be a JSON object, not {text!r}")
    return value


@dataclass
class GenerateOptions:
    out: Path
    model: str | None = None
    data: list[Path] = field(default_factory=list)
    backend: str | None = None
    turns: str | None = None  # all | last
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    samples_per_prompt: int | None = None
    seed: int | None = None
    template_kwargs: dict | None = None
    max_length: int | None = None
    shard_size: int | None = None
    dtype: str | None = None
    device: str | None = None
    trust_remote_code: bool = False
    deep_verify: bool = True
    allow_partial: bool = False
    reserve_bytes: int | None = None
    # how this session reaches its engine: not part of the spec
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    servers: list[str] = field(default_factory=list)
    concurrency: int | None = None
    server_api: str | None = None  # openai | sglang (None: found out per server)
    server_model: str | None = None  # the served model name (None: the one the server lists)
    max_pending: int | None = None
    metrics_port: int | None = None
    metrics_textfile: Path | None = None

    def __post_init__(self) -> None:
        checks: list[tuple[str, object, Callable[[object], bool], str]] = [
            ("backend", self.backend, lambda v: v in ENGINES, f"one of {', '.join(ENGINES)}"),
            ("turns", self.turns, lambda v: v in ("all", "last"), "all or last"),
            ("temperature", self.temperature, lambda v: 0 <= v <= 100, "0 (greedy) or more"),
            ("top-p", self.top_p, lambda v: 0 < v <= 1, "greater than 0, at most 1"),
            ("top-k", self.top_k, lambda v: v >= 0, "0 (off) or more"),
            ("max-new-tokens", self.max_new_tokens, lambda v: v >= 1, "1 or more"),
            ("samples-per-prompt", self.samples_per_prompt, lambda v: 1 <= v <= 1000, "1 to 1000"),
            ("seed", self.seed, lambda v: 0 <= v < 2**63, "0 to 2**63-1"),
            ("max-length", self.max_length, lambda v: v >= 2, "2 or more"),
            ("shard-size", self.shard_size, lambda v: v >= 1, "1 or more"),
            ("dtype", self.dtype, lambda v: v in DTYPES, ", ".join(DTYPES)),
            ("tensor-parallel-size", self.tensor_parallel_size, lambda v: v >= 1, "1 or more"),
            ("data-parallel-size", self.data_parallel_size, lambda v: v >= 1, "1 or more"),
            ("concurrency", self.concurrency, lambda v: v >= 1, "1 or more"),
            ("max-pending", self.max_pending, lambda v: v >= 1, "1 or more"),
        ]
        for option, value, ok, allowed in checks:
            if value is not None and not ok(value):
                raise _refuse(option, value, allowed)

    def sampling_given(self) -> dict:
        """The sampling options given on the command line, by the spec's names."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }
        return {k: v for k, v in given.items() if v is not None}

    def sampling(self) -> Sampling:
        """A new run's sampling: the given options over ``SAMPLING``'s defaults."""
        s = SAMPLING
        g = self.sampling_given()
        sampling = Sampling(
            g.get("temperature", s.temperature),
            g.get("top_p", s.top_p),
            g.get("top_k", s.top_k),
            g.get("max_new_tokens", s.max_new_tokens),
        )
        if self.samples_per_prompt and self.samples_per_prompt > 1 and sampling.temperature == 0:
            raise OptionError("--samples-per-prompt above 1 needs --temperature above 0 (greedy repeats itself)")
        return sampling

    def get(self, name: str):
        """A run-shaping option's value, or its default for a new run."""
        value = getattr(self, name)
        return DEFAULTS[name] if value is None else value

    def engine_settings(
        self,
        model_dir: Path,
        dtype: str,
        trust_remote_code: bool,
        seed: int,
        max_length: int,
        stop_ids: frozenset[int],
    ) -> EngineSettings:
        return EngineSettings(
            model_dir=model_dir,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            device=self.device,
            seed=seed,
            max_length=max_length,
            stop_ids=stop_ids,
            tensor_parallel_size=self.tensor_parallel_size or 1,
            data_parallel_size=self.data_parallel_size or 1,
            servers=tuple(self.servers),
            concurrency=self.concurrency or 64,
            max_pending=self.max_pending,
            extra={k: v for k, v in (("server_api", self.server_api), ("server_model", self.server_model)) if v},
        )

    def telemetry(self, metrics: Callable[[], dict]) -> Telemetry:
        return Telemetry(self.out, metrics, self.metrics_port, self.metrics_textfile)
