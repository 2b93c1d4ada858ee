"""A generate run's spec, ``GEN/hsx.json`` (``kind: generate``): written once, the only source of truth
for its resume, as an extraction's spec is for its own (read, as every spec, by ``hsx.spec.read_spec``).

It pins what the generated tokens are a function of: the model, tokenizer and chat template (with
the keyword arguments passed to it), the engine and its version, the sampling, the seed, the turns
mode, samples per prompt, the length limit, the source data and the frozen input plan. A resume
asking for anything else is refused with the differences named (``hsx.spec.differences`` for what
both kinds of run share, the generate settings beside it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, model_serializer

from hsx import __version__
from hsx.fingerprint import digest_bytes
from hsx.spec import (
    GENERATE,
    DataFile,
    Footprint,
    ModelIdentity,
    PlanIdentity,
    RunSpec,
    TokenizerIdentity,
    differences,
    kind_of,
    load_spec,
    read_spec,
    setting_differences,
)
from hsx.store import layout
from hsx.store.durable import write_durable

FORMAT = "hsx-generate/1"
Turns = Literal["all", "last"]
BYTES_PER_TOKEN = 8  # a stored token: its id (int32) and, on average, about as many bytes of decoded text


class EngineIdentity(BaseModel):
    name: str  # transformers | vllm | server
    version: str  # what the engine reports: its package version (a server: what it says it runs)


class SamplingSpec(BaseModel):
    """How the engine drew tokens (``generate.engines.base.Sampling``), as the spec stores it."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int


class GenerateSpec(BaseModel):
    kind: Literal["generate"] = GENERATE
    format: Literal["hsx-generate/1"] = FORMAT
    hsx_version: str = __version__
    created: str
    created_by: str
    model: ModelIdentity
    tokenizer: TokenizerIdentity
    template_kwargs: dict[str, Any]
    chat_template: str | None = None  # the tokenizer's named template asked for; None: transformers' pick
    engine: EngineIdentity
    sampling: SamplingSpec
    seed: int
    turns: Turns
    samples_per_prompt: int
    max_length: int  # no prompt + completion of the run is longer (a turn's new tokens are capped to fit)
    shard_size: int
    dtype: str
    trust_remote_code: bool = False
    # how the target's reasoning and tool calls are read from its completions: a parser's name
    # (generate.toolcalls), "response_template" (the tokenizer's own), or None (content only)
    tool_parser: str | None = None
    data: list[DataFile]
    plan: PlanIdentity  # num_samples: conversations; num_tokens: the plan's estimate of tokens to store
    drop: list[str] = []  # --drop: answers that reject their conversation (empty, length)
    model_files: bool = False  # keeps model-files.json (``spec.RunSpec.model_files``)

    @model_serializer(mode="wrap")
    def _given_only(self, handler) -> dict:
        """``drop`` and ``model_files`` only where set: the spec of a run without them reads (and
        digests) as before."""
        return {k: v for k, v in handler(self).items() if k not in ("drop", "model_files") or v}

    def footprint(self) -> Footprint:
        """Conversation files store token ids and texts, no states: no storage codec."""
        return Footprint(BYTES_PER_TOKEN)

    def digest(self) -> str:
        """What an extraction of this run records: this spec's content."""
        return digest_bytes(self.model_dump_json().encode())

    def save(self, run: Path) -> None:
        write_durable(run / layout.SPEC, self.model_dump_json(indent=2).encode())


def is_generate_run(path: Path) -> bool:
    return path.is_dir() and kind_of(path) == GENERATE


def load_generate_spec(run: Path) -> GenerateSpec:
    return read_spec(run, GENERATE, GenerateSpec)


def load_any(run: Path) -> RunSpec | GenerateSpec:
    """The spec of an extraction or of a generate run, by the kind it records (assessed alike)."""
    return load_generate_spec(run) if kind_of(run) == GENERATE else load_spec(run)


def generate_differences(stored: GenerateSpec, asked: dict) -> list[str]:
    """One line per setting a resume asks for that the run does not have: the model, tokenizer,
    template, data, length, shard size and backend as ``hsx.spec.differences`` says them, then the
    generate settings (``sampling``: the sampling options given, by name; ``seed``, ``turns``, ``samples_per_prompt``,
    ``template_kwargs``, ``chat_template``, ``tool_parser``, ``engine_version``)."""
    shared = ("model", "tokenizer", "data", "column", "split", "limit", "max_length", "shard_size")
    out = differences(stored, {k: asked[k] for k in shared if k in asked})
    if (v := asked.get("backend")) is not None and v != stored.engine.name:
        out.append(f"backend: run has {stored.engine.name}, asked for {v}")
    for name, want in asked.get("sampling", {}).items():
        have = getattr(stored.sampling, name)
        if want is not None and want != have:
            out.append(f"sampling: {name.replace('_', ' ')}: run has {have}, asked for {want}")
    out += setting_differences(
        stored,
        asked,
        ("seed", "turns", "samples_per_prompt", "template_kwargs", "chat_template", "drop", "tool_parser"),
    )
    if (v := asked.get("engine_version")) is not None and v != stored.engine.version:
        out.append(f"engine: run was generated with {stored.engine.name} {stored.engine.version}, this is {v}")
    return out
