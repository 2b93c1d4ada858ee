"""What the operator asked ``hsx generate`` for, parsed and range-checked once: ``GenerateOptions``.

``None`` means "not given": a new run takes ``DEFAULTS``, a resume takes the spec's value, and a
value given on a resume must equal the spec's (``spec.generate_differences``). Each option's range
is declared once (``GENERATE``, the shared ones in ``job.options.JOB``): the command line enforces
it while parsing, and ``GenerateOptions.__post_init__`` refuses the same values for a Python caller
before anything is read.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated as A
from typing import ClassVar

from hsx.bounds import Bound, Bounds, Flag
from hsx.errors import OptionError
from hsx.generate.engines import ENGINES, EngineSettings
from hsx.generate.engines.base import Sampling
from hsx.generate.toolcalls import PARSERS
from hsx.job.options import DAY, JOB, TOKENS, JobOptions, check_device, check_vllm, flag_name

DEFAULTS = {
    "backend": "transformers",
    "turns": "all",
    "samples_per_prompt": 1,
    "seed": 0,
    "max_length": 4096,
    "shard_size": 1000,
    "dtype": "auto",
}
SAMPLING = Sampling()  # its defaults: greedy, 2048 new tokens at most
GENERATE = Bounds(
    **JOB.bounds,
    backend=Bound(choices=tuple(ENGINES)),
    turns=Bound(choices=("all", "last")),
    temperature=Bound(min=0.0, max=100.0),
    top_p=Bound(min=0.0, max=1.0, min_open=True),
    top_k=Bound(min=0, max=10**7),  # 0: off; else at most a vocabulary
    max_new_tokens=TOKENS,
    samples_per_prompt=Bound(min=1, max=1000),
    seed=Bound(min=0, max=2**63 - 1),
    max_length=Bound(min=2, max=TOKENS.max),  # a prompt token and a new one
    concurrency=Bound(min=1, max=100_000),
    server_api=Bound(choices=("openai", "openai-chat", "sglang")),
    tool_parser=Bound(choices=tuple(PARSERS)),
    max_pending=Bound(min=1, max=10**6),
    server_timeout=Bound(min=0.0, max=DAY, min_open=True),
    server_retries=Bound(min=1, max=1000),
    server_backoff=Bound(min=0.0, max=3600.0),
)
DROPS = ("empty", "length")  # --drop: answers rejected rather than kept (an empty one; one cut at the length limit)


# the options only the server backend reads
SERVER_ONLY = (
    "servers",
    "concurrency",
    "server_api",
    "server_model",
    "server_timeout",
    "server_retries",
    "server_backoff",
)


def drops(given: list[str] | None) -> list[str] | None:
    """``--drop empty,length`` (repeatable)."""
    return [x for s in given or [] for x in s.split(",")] or None


DROP = "Reject conversations with an empty or length-cut answer (comma-separated)."
API = "server backend: openai (/v1/completions), openai-chat (/v1/chat/completions) or sglang (/generate)."
TOOL_PARSER = f"How the target's tool calls are read: {', '.join(PARSERS)}."


@dataclass
class GenerateOptions(JobOptions):
    COMMAND: ClassVar[str] = "generate"
    UNIT: ClassVar[str] = "conversations"
    BOUNDS: ClassVar[Bounds] = GENERATE

    # of DROPS: such answers reject their conversation, with the reason (spec)
    drop: A[list[str] | None, Flag(DROP, "empty,length", "none", parse=drops)] = None
    backend: A[str | None, Flag("What generates (new run).")] = None
    max_length: A[int | None, Flag("Prompt + completion of a turn at most.")] = None
    shard_size: A[int | None, Flag("Conversations per shard folder.")] = None
    turns: A[str | None, Flag("all: every assistant turn, on the target's own answers; last: the last only.")] = None
    temperature: A[float | None, Flag("0: greedy.")] = None
    top_p: A[float | None, Flag("Nucleus sampling (1: off).")] = None
    top_k: A[int | None, Flag("Top-k sampling (0: off).")] = None
    max_new_tokens: A[int | None, Flag("New tokens per turn at most.")] = None
    samples_per_prompt: A[int | None, Flag("Conversations generated per input row.")] = None
    seed: A[int | None, Flag("The run's seed; each request's derives from it.")] = None
    # generate.toolcalls.PARSERS (None: the tokenizer's response template, if any)
    tool_parser: A[str | None, Flag(TOOL_PARSER, "NAME", "the tokenizer's response template")] = None
    # how this session reaches its engine: not part of the spec
    servers: A[
        list[str], Flag("server backend: an OpenAI-compatible base URL; repeatable.", "URL", "none", name="--server")
    ] = field(default_factory=list)
    concurrency: A[int | None, Flag("server backend: requests in flight per server.", default="64")] = None
    server_api: A[str | None, Flag(API, default="found out per server")] = None  # None: found out per server
    # the served model name (None: the one the server lists)
    server_model: A[str | None, Flag("server backend: the served model's name.", "NAME", "its only one")] = None
    max_pending: A[int | None, Flag("Requests kept submitted to the engine.", default="the engine's own choice")] = None
    # seconds one request may take (None: the server backend's default)
    server_timeout: A[float | None, Flag("server backend: seconds a request may take.", "SECONDS", "3600")] = None
    # tries of a request on one server before it counts as a failure
    server_retries: A[int | None, Flag("server backend: tries of a request on a server.", default="5")] = None
    # first wait between tries, doubling (up to 30 s)
    server_backoff: A[float | None, Flag("server backend: first wait between tries, doubling.", "SECONDS", "1")] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if unknown := [d for d in self.drop or [] if d not in DROPS]:
            raise OptionError(f"--drop takes {', '.join(DROPS)} (comma-separated), not {', '.join(map(repr, unknown))}")
        if self.device is not None:
            check_device(self.device)
        if self.backend == "vllm":
            check_vllm("--backend vllm")
        if self.backend == "server" and not self.servers:
            raise OptionError("--backend server needs the servers to send requests to: give each with --server URL")
        for url in self.servers:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise OptionError(f"--server takes an http:// or https:// URL of a server, not {url!r}")

    def refuse_unused(self, backend: str) -> None:
        """Options the run's engine would ignore, refused by name before anything is written:
        ``backend`` is the run's (its spec's engine on a resume)."""
        engine = {"server": SERVER_ONLY, "vllm": ("tensor_parallel_size",)}
        for name, owned in engine.items():
            given = [flag_name(type(self), k) for k in owned if getattr(self, k) not in (None, [])]
            if given and backend != name:
                raise OptionError(
                    f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --backend {name}; "
                    f"this run generates with {backend}"
                )

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
        tokenizer=None,
    ) -> EngineSettings:
        return EngineSettings(
            model_dir=model_dir,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            device=self.device,
            threads=self.threads,
            seed=seed,
            max_length=max_length,
            stop_ids=stop_ids,
            tensor_parallel_size=self.tensor_parallel_size or 1,
            servers=tuple(self.servers),
            concurrency=self.concurrency or 64,
            max_pending=self.max_pending,
            extra={
                f"server_{k}": v
                for k in ("api", "model", "timeout", "retries", "backoff")
                if (v := getattr(self, f"server_{k}")) is not None
            },
        )
