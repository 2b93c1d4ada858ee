"""The run spec, ``OUT/hsx.json``: written once, atomically; the only source of truth for a resume.

It pins everything the output is a function of: model identity, tokenizer and chat template,
layers and their convention, dtype, max length, batching, the source data and the plan. A resume
whose settings differ from it is refused with the differences listed (invariant 3).

Every spec records its run's kind (``extract``: ``RunSpec``; ``generate``: ``genrun.spec.GenerateSpec``)
and is read by ``read_spec`` alone, which infers the kind of an older spec that does not record it
and refuses a run of another kind by name; the rest of hsx reads ``spec.kind``.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ValidationError, model_serializer

from hsx import __version__
from hsx.drafts import bytes_per_token
from hsx.errors import RecordDamaged, SpecError
from hsx.fingerprint import ModelFingerprint, digest_file
from hsx.store import layout, records
from hsx.store.codec import Codec
from hsx.store.durable import write_durable
from hsx.store.format import FINAL_STATE, LAYER_CONVENTION, Expected, FinalStateNorm
from hsx.units import size

FORMAT = "hsx-run/1"
EXTRACT, GENERATE = "extract", "generate"  # the kinds of run; each is the command that resumes it
Record = TypeVar("Record", bound=BaseModel)


class Quantization(BaseModel):
    """How the checkpoint stores its weights, as its config.json's ``quantization_config`` says."""

    method: str  # its quant_method: fp8 (block-scaled, as DeepSeek-V3 and Kimi-K2 are released), compressed-tensors...
    config: dict[str, Any]  # the quantization_config as config.json has it
    # routed experts hsx keeps in their stored form and expands per MoE layer to the run's dtype
    # (hsx.capture.quantized), e.g. "int4-packed group 32"; None: loaded as transformers loads them
    experts: str | None = None

    def __str__(self) -> str:
        rest = ", ".join(f"{k} {v}" for k, v in sorted(self.config.items()) if k != "quant_method")
        held = f"; routed experts {self.experts}, expanded per layer to the run's dtype" if self.experts else ""
        return (f"{self.method} ({rest})" if rest else self.method) + held


class ModelIdentity(BaseModel):
    # a local folder absolute (runs made before hsx resolved it: as typed), a hub id as given; where a
    # resume looks first, not the identity: that is the fingerprint, so a moved model still matches
    path: str
    architecture: str
    num_layers: int
    hidden_size: int
    fingerprint: ModelFingerprint
    # None: unquantized weights. A spec written before hsx recorded this has no such key, and
    # is then not compared (see ``differences``)
    quantization: Quantization | None = None


class TokenizerIdentity(BaseModel):
    digest: str  # the tokenizer's vocabulary, merges, normaliser and special tokens
    chat_template: str  # digest of the template text (of a repository's named templates, all of them)
    # which class planned the run (a repository's by auto_map, slow ones marked) and the files it was
    # built from (name -> digest); None in specs written before hsx recorded them
    tokenizer_class: str | None = None
    files: dict[str, str] | None = None


# How this hsx's fp8 route quantizes activations, as a run's spec records it (``fp8_activations``):
# the Triton kernel of ``capture.quantized.fp8_kernel``. Before it, compiled torch code quantized the
# fused float32 values, with other roundings. A new name with any change of the kernel's numbers.
FP8_ACTIVATIONS = "triton-kernel/1"
OPTIONAL_DATA = ("split", "limit", "column")  # a DataFile's fields written only where given
# RunSpec's fields written only where not these
DRAFT_DEFAULTS = {
    "layers_formula": None,
    "final_norm": "post",
    "expert_slice_gb": None,
    "fp8_activations": None,
    "teacher": None,
    "model_files": False,
}


class DataFile(BaseModel):
    """One ``--data`` source as read: a file (its bytes), or a Hugging Face dataset (the Arrow files of
    its split; ``name`` the dataset's name as given, or the folder), with the run's ``--limit`` and
    ``--column``."""

    name: str  # absolute (runs made before hsx resolved it: as typed); the identity is size and digest
    size: int
    digest: str
    split: str | None = None  # a Hugging Face dataset's split read
    limit: int | None = None  # the run's row limit (the first rows over all sources), if any
    column: str | None = None  # the field the turns were read from (--column), if one was named

    @classmethod
    def of(cls, path: Path, split: str | None = None, limit: int | None = None, column: str | None = None) -> DataFile:
        from hsx import hfdatasets

        if path.is_file():
            size, digest = path.stat().st_size, digest_file(path)
        else:
            size, digest = hfdatasets.identity(path, split)
        name = str(path) if hfdatasets.is_name(path) else str(path.expanduser().resolve())
        return cls(name=name, size=size, digest=digest, split=split, limit=limit, column=column)

    def key(self) -> tuple:
        """What must match on a resume, but for the column (``differences`` names it apart): the
        content, and what of it was read."""
        return self.size, self.digest, self.split, self.limit

    @model_serializer(mode="wrap")
    def _given_only(self, handler) -> dict:
        """``split``, ``limit`` and ``column`` only where given: a source read whole is written as
        before, so a digest over a spec (an extraction records its generate run's) stays what it was."""
        return {k: v for k, v in handler(self).items() if k not in OPTIONAL_DATA or v is not None}


class PlanIdentity(BaseModel):
    fingerprint: str
    num_samples: int
    num_tokens: int
    num_truncated: int
    num_rejected: int
    # what the chat template did not render or rendered in samples of their own, by hsx.plan.COUNTS
    # key, and metadata fields -> rows holding them; empty in runs made before hsx counted them
    rendering: dict[str, int] = {}
    ignored_fields: dict[str, int] = {}
    # files under plan/ appended after plan.parquet, in order, and the fingerprint of the plan as the
    # spec recorded it (``PlanGrowth``); empty until the plan grew
    parts: list[str] = []
    grown_from: str | None = None

    @property
    def origin(self) -> str:
        """The fingerprint of the plan as first written: what a grown plan still is the growth of."""
        return self.grown_from or self.fingerprint

    @model_serializer(mode="wrap")
    def _growth_once_grown(self, handler) -> dict:
        """``parts`` and ``grown_from`` only once the plan grew: one that never did is written as
        before, so a digest over a spec (an extraction records its generate run's) stays what it was."""
        return {k: v for k, v in handler(self).items() if k not in ("parts", "grown_from") or v}

    @classmethod
    def of(cls, info, rejected: int) -> PlanIdentity:
        """The identity of a plan just written (``hsx.plan.PlanInfo``) and the rows it rejected."""
        return cls(
            fingerprint=info.fingerprint,
            num_samples=info.num_samples,
            num_tokens=info.num_tokens,
            num_truncated=info.num_truncated,
            num_rejected=rejected,
            rendering=info.rendering,
            ignored_fields=info.ignored_fields,
        )


class Window(BaseModel):
    """``--window``: the extraction pauses while the bytes of its samples that the named consumers
    have not all released exceed ``bytes`` (docs/streaming.md), or past them ``limit`` where the
    operator let it go further while they lag. It changes no number, only when samples are written."""

    bytes: int
    consumers: list[str]
    delete: bool = False  # released files are deleted (recorded consumed first: store.writer.record_consumed)
    plane: str | None = None  # each sample's bytes also put in this data plane until released (hsx.plane)
    # ``--window-limit``: past ``bytes``, the extraction goes on up to this many while the consumers lag
    limit: int | None = None

    @property
    def pause_at(self) -> int:
        """The bytes held at which the extraction pauses: the limit where the run has one, else the window."""
        return self.bytes if self.limit is None else self.limit

    def __str__(self) -> str:
        deleting = ", deleting released files" if self.delete else ""
        plane = f", through {self.plane}" if self.plane else ""
        limit = f", past it up to {size(self.limit)} while they lag" if self.limit is not None else ""
        return f"{size(self.bytes)} for {', '.join(self.consumers)}{limit}{deleting}{plane}"


class Parallel(BaseModel):
    """How one model replica is laid over the devices of a node. Part of the spec, since the
    numerics depend on it: TP and EP change the order of reductions (and MoE router near-ties).
    A pipeline changes no bit (each stage runs the same modules on the same inputs as one process:
    tested byte for byte on CPU); it is recorded with the rest of the layout, and a resume that
    asks for another is refused like any layout change, until GPUs have shown the same."""

    tensor: int = 1  # ranks the dense layers are split over (transformers' TP plan), in each stage
    expert: int = 1  # ranks the routed experts are split over (its EP plan): 1 or ``tensor``
    pipeline: int = 1  # stages of contiguous decoder layers (capture.stages), each over ``tensor`` ranks

    @property
    def ranks(self) -> int:
        return self.tensor * self.pipeline

    def __str__(self) -> str:
        staged = f", pipeline {self.pipeline}" if self.pipeline > 1 else ""
        return f"tensor {self.tensor}, expert {self.expert}{staged}"


class FidelityCheck(BaseModel):
    """How a run checks that its states are the target's own (``hsx.fidelity``): which tokens, and
    what stops it. Every ``stride``-th loss-masked next token of a sample is checked (the sampling:
    the same tokens in every process and resume). ``floor``: a run whose data is this model's own
    temperature-0 output (``mode`` floor) stops where agreement, near ties counted, falls under it;
    any other data (``mode`` baseline) is held to its first batches' agreement: a fall by more than
    ``drop`` of it stops the run. The baseline, measured after the spec is written, is recorded
    beside it (``fidelity.json``), as are limits a resume changed."""

    mode: Literal["floor", "baseline"]
    stride: int = 8
    floor: float = 0.98
    drop: float = 0.5

    def rule(self, baseline: float | None = None) -> str:
        """What stops the run, in words (``baseline``: its agreement, once measured)."""
        if self.mode == "floor":
            return f"the floor {self.floor:.1%} (the data is this model's own temperature-0 output)"
        if baseline is None:
            return f"{1 - self.drop:.0%} of the baseline its first batches set"
        return f"{1 - self.drop:.0%} of the run's baseline {baseline:.1%}"


class TeacherSpec(BaseModel):
    """``--teacher``: the target's own next-token distribution stored beside its states
    (``hsx.teacher``), one row per loss-masked position. ``topk``: its ``k`` largest
    log-probabilities over the full vocabulary and their token ids; ``draft-vocab``: its
    probabilities over the ``vocab_size`` token ids of a draft vocabulary (the run keeps them:
    ``layout.TEACHER_VOCAB``, ``vocab_digest`` its digest) and the full vocabulary's argmax.
    ``masked_share``: the plan's loss-masked tokens per token, which the space forecast counts."""

    kind: Literal["topk", "draft-vocab"]
    k: int = 0
    vocab_size: int = 0
    vocab_digest: str | None = None
    masked_share: float = 1.0

    def row_bytes(self, itemsize: int) -> int:
        """Bytes one masked token's row takes: int32 ids and values in the run's dtype."""
        return self.k * (4 + itemsize) if self.kind == "topk" else self.vocab_size * itemsize + 4

    def label(self) -> str:
        """What each sample file's ``teacher`` metadata says (the choice, the plan's share aside)."""
        body = self.model_dump(exclude={"masked_share"}, exclude_defaults=True)
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    def same_choice(self, other: TeacherSpec) -> bool:
        """The same distribution stored (the plan's share aside)."""
        return (self.kind, self.k, self.vocab_size, self.vocab_digest) == (
            other.kind, other.k, other.vocab_size, other.vocab_digest,
        )  # fmt: skip

    def __str__(self) -> str:
        if self.kind == "topk":
            return f"top-{self.k} log-probabilities over the full vocabulary"
        return f"probabilities over a draft vocabulary of {self.vocab_size} ({self.vocab_digest})"


class CertifyCheck(BaseModel):
    """How a run checks its taps (``hsx.certify``): every sample's per-tap checks, and the shadow's
    recomputation of 1 in ``every`` samples by id (0: none) and of every id below ``first``."""

    every: int = 1000
    first: int = 4


@dataclass(frozen=True)
class Footprint:
    """What a run's files take on disk, as the space forecast and the store's scan need it:
    ``bytes_per_token`` raw; ``codec`` its states are stored with (None: its files hold no states,
    any codec a scan finds is the file's own); a state value's ``itemsize`` and ``hidden_size``
    (a codec's ratio depends on them); ``batch_tokens``: the most tokens one batch holds (0: a
    sample at a time); ``files``: what each file's header must say (a scan judges by it)."""

    bytes_per_token: int
    codec: Codec | None = None
    itemsize: int = 0
    hidden_size: int = 0
    batch_tokens: int = 0
    files: Expected | None = None  # what each sample file says of itself (None: files of no states)


class JobSpec(Protocol):
    """What the job layer (``hsx.job``: lock, verification, space, model location) reads of a run's
    spec, whatever the run's kind: an extraction's ``RunSpec``, a generate run's ``GenerateSpec``
    (``genrun.spec``). ``kind`` says which, and names the command that resumes it."""

    @property
    def kind(self) -> str: ...
    @property
    def model(self) -> ModelIdentity: ...
    @property
    def tokenizer(self) -> TokenizerIdentity: ...
    @property
    def data(self) -> list[DataFile]: ...
    @property
    def max_length(self) -> int: ...
    @property
    def shard_size(self) -> int: ...
    @property
    def plan(self) -> PlanIdentity: ...
    @property
    def trust_remote_code(self) -> bool: ...
    @property
    def model_files(self) -> bool: ...
    def footprint(self) -> Footprint: ...
    def save(self, run: Path) -> None: ...


class RunSpec(BaseModel):
    kind: Literal["extract"] = EXTRACT  # runs made before hsx recorded it have none: ``kind_of`` says extract
    format: Literal["hsx-run/1"] = FORMAT
    hsx_version: str = __version__
    created: str
    created_by: str
    backend: str
    model: ModelIdentity
    tokenizer: TokenizerIdentity
    layers: list[int]  # the taps, in hsx ids; empty for a run of the final state alone (--layers mtp)
    layers_formula: str | None = None  # the draft preset's formula that gave them (hsx.drafts); None: given as ids
    layer_convention: str = LAYER_CONVENTION
    final_state: str = FINAL_STATE
    final_norm: FinalStateNorm = "post"  # the final state stored after the final norm, or before it
    dtype: str
    max_length: int
    batch_tokens: int
    shard_size: int
    trust_remote_code: bool = False
    packed: bool = False  # samples packed in one row per batch (hsx_varlen attention) instead of padded rows
    compiled: bool = False  # decoder layers run through torch.compile (fused element-wise kernels)
    codec: Codec = Codec.RAW  # how states are stored (store.codec); runs made before codecs are raw
    parallel: Parallel = Parallel()  # runs made before tensor parallel ran in one process
    # how an FP8 checkpoint computes: fp8 (block FP8 GEMMs, activations quantized) or dequantized
    # (weights expanded to the dtype); None: unquantized weights, or a run made before hsx recorded it
    quantized_compute: str | None = None
    # on the fp8 route, how the activations are quantized (``fp8.ACTIVATIONS``); None: not on it, or a
    # run made before hsx recorded it, whose quantization was compiled torch code (``FP8_ACTIVATIONS``)
    fp8_activations: str | None = None
    # GB of routed experts expanded at once (--expert-slice-gb: hsx.capture.quantized.experts.sliced); None:
    # a whole MoE layer's, as runs made before. The same states on CPU (tested); recorded since a compiled
    # layer on CUDA runs the slices outside its graph, whose fused kernels may round otherwise
    expert_slice_gb: float | None = None
    # the run keeps its model's files in model-files.json (target.record_files): missing, it is damage,
    # not a run made before hsx kept one (those compare the model by the fingerprint's probes)
    model_files: bool = False
    # the chat template's arguments the plan rendered with (--chat-template-kwargs); runs made before: none
    template_kwargs: dict[str, Any] = {}
    # the tokenizer's named template asked for (--chat-template); None: transformers' pick per row
    chat_template: str | None = None
    data: list[DataFile]
    generate_spec: str | None = None  # the data is a generate run: the digest of its spec
    plan: PlanIdentity
    fidelity: FidelityCheck | None = None  # None: a run made before hsx checked fidelity checks nothing
    window: Window | None = None  # pause while what the named consumers have not released exceeds it
    teacher: TeacherSpec | None = None  # the target's distribution stored beside its states (--teacher)
    certify: CertifyCheck | None = None  # None: a run made before hsx checked its taps checks none

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs on disk: L aux states + the final state + input id + mask, and the
        teacher's row at the plan's share of masked tokens (rounded up)."""
        base = bytes_per_token(len(self.layers), self.model.hidden_size, self.state_itemsize)
        if self.teacher is None:
            return base
        return base + math.ceil(self.teacher.row_bytes(self.state_itemsize) * self.teacher.masked_share)

    @property
    def state_itemsize(self) -> int:
        """Bytes of one value of a state in the run's dtype."""
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    def footprint(self) -> Footprint:
        return Footprint(
            self.bytes_per_token,
            self.codec,
            self.state_itemsize,
            self.model.hidden_size,
            self.batch_tokens,
            self.expected(),
        )

    def expected(self) -> Expected:
        """What each of the run's sample files says of itself (``store.format.Expected``)."""
        teacher = None if self.teacher is None else self.teacher.label()
        return Expected(self.codec, tuple(self.layers), self.final_norm, self.dtype, self.model.hidden_size, teacher)

    def save(self, run: Path) -> None:
        write_durable(run / layout.SPEC, self.model_dump_json(indent=2).encode())

    @model_serializer(mode="wrap")
    def _drafts_where_asked(self, handler) -> dict:
        """``layers_formula``, ``final_norm``, ``expert_slice_gb``, ``fp8_activations`` and ``teacher``
        only where a run asked for them: a run given ids, the post-norm final state and whole-layer
        expansion, off the fp8 route, storing no teacher, is written as before."""
        out = handler(self)
        return {k: v for k, v in out.items() if k not in DRAFT_DEFAULTS or v != DRAFT_DEFAULTS[k]}


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class ModelLocation(BaseModel):
    """``OUT/model-location.json``: where the run's model is now, once it moved. Written (atomically,
    replaced whole) only by a resume that matched the model there against the spec's fingerprint;
    the spec keeps the path the run started with."""

    path: str
    recorded: str  # when (UTC, ISO 8601)
    by: str  # user@host
    previous: str  # where the run looked for it before


def model_location(run: Path, spec: JobSpec) -> str:
    """Where the run's model is: the last location a resume recorded, else the spec's path."""
    recorded = read_record(run, run / layout.LOCATION, ModelLocation)
    return spec.model.path if recorded is None else recorded.path


def record_location(run: Path, spec: JobSpec, path: str) -> bool:
    """Record ``path`` (its fingerprint already matched) as the model's location; False when it
    is where the run already looks."""
    previous = model_location(run, spec)
    if same_place(previous, path):
        return False
    record = ModelLocation(path=path, recorded=now(), by=who(), previous=previous)
    write_record(run, run / layout.LOCATION, record)
    return True


def same_place(a: str, b: str) -> bool:
    """Two model locations name the same folder (or the same hub id)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


class Extension(BaseModel):
    """One growth of a plan: the samples of conversations its generate run finished since."""

    part: str | None  # the file under plan/ holding the samples; None when they all became rejects
    first_id: int  # the first sample id it added
    num_samples: int
    conversations: list[int]  # the generate run's conversation ids it took
    rejects: list[dict]  # those of them not planned, with the reason (lines of rejects.jsonl)
    recorded: str  # when (UTC, ISO 8601)
    by: str  # user@host


class PlanGrowth(BaseModel):
    """``OUT/plan/growth.json``: an extraction of an unfinished generate run, grown as the generate run
    finished conversations. Replaced whole (atomically) at each growth, by a resume under the run's
    lock; the spec and every sample id already planned stay as they were. ``load_spec`` reads the run's
    plan and data from it, so every reader sees the grown plan."""

    extensions: list[Extension]
    waiting: list[int]  # the generate run's conversation ids still not generated
    plan: PlanIdentity  # the whole plan now
    data: list[DataFile]  # the generate run as last read (its planned conversations)


def read_record(run: Path, path: Path, kind: type[Record]) -> Record | None:
    """A record of ``run`` kept beside the spec (invariant 8) as ``kind``, self-verifying
    (``store.records``): None where there is none yet; ``SpecError`` where it is unreadable,
    damaged or another run's."""
    try:
        body = records.read_record(run, path)
        return None if body is None else kind.model_validate(body)
    except RecordDamaged as e:
        raise SpecError(f"{path} is unreadable or damaged: {e.why}") from e
    except (ValidationError, ValueError) as e:
        raise SpecError(f"{path} is unreadable or damaged: {str(e).splitlines()[0]}") from e


def write_record(run: Path, path: Path, record: BaseModel) -> None:
    """Replace a record of ``run`` kept beside the spec, whole, stamped (``store.records``)."""
    records.write_record(run, path, record.model_dump(mode="json"), indent=1)


def plan_growth(run: Path) -> PlanGrowth | None:
    """The run's growth record, or None when its plan never grew."""
    return read_record(run, run / layout.PLAN_DIR / layout.GROWTH, PlanGrowth)


def kind_of(run: Path) -> str | None:
    """The kind of run ``run`` holds, as its spec records it (``extract`` or ``generate``); None when it
    has no readable spec."""
    try:
        body = json.loads((run / layout.SPEC).read_bytes())
    except (OSError, ValueError):
        return None
    return _kind(body) if isinstance(body, dict) else None


def _kind(body: dict) -> str:
    """The kind a spec records; an extraction's spec written before hsx recorded it has none (a generate
    run's always had one)."""
    return body.get("kind", EXTRACT)


WRONG_KIND = {  # (kind asked for, kind found) -> what the refusal says
    (EXTRACT, GENERATE): "{run} is a generate run (hsx generate), not an extraction: extract it with --data {run}",
    (GENERATE, EXTRACT): "{run} is an extraction run (hsx extract), not a generate run",
}


def read_spec(run: Path, kind: str, model: type[Record]) -> Record:
    """The spec of ``run``, a run of ``kind`` (``model``: its class): every spec hsx reads is read here,
    its kind inferred where an older spec does not record it and refused where it is another."""
    path = run / layout.SPEC
    try:
        raw = path.read_bytes()
        body = json.loads(raw)
        found = _kind(body) if isinstance(body, dict) else kind
        if found != kind:
            raise SpecError(WRONG_KIND.get((kind, found), "{run} is a run of another kind: " + found).format(run=run))
        return model.model_validate_json(raw)
    except FileNotFoundError as e:
        raise SpecError(f"{run} has no run spec ({layout.SPEC}): not an hsx run folder") from e
    except (ValidationError, ValueError) as e:
        raise SpecError(f"{path} is unreadable or damaged: {str(e).splitlines()[0]}") from e


def load_spec(run: Path) -> RunSpec:
    """An extraction's spec, with its plan and data as grown since (``PlanGrowth``), if they grew."""
    spec = read_spec(run, EXTRACT, RunSpec)
    growth = plan_growth(run)
    return spec if growth is None else spec.model_copy(update={"plan": growth.plan, "data": growth.data})


# the settings a resume's ask is compared with as they are stored (``differences``)
SETTINGS = (
    "layers",
    "dtype",
    "max_length",
    "batch_tokens",
    "shard_size",
    "backend",
    "packed",
    "compiled",
    "codec",
    "parallel",
    "quantized_compute",
    "expert_slice_gb",
    "template_kwargs",
    "chat_template",
    "final_norm",
    "window",
)


def setting_differences(stored: object, asked: dict, keys: Sequence[str]) -> list[str]:
    """One line per setting of ``keys`` that ``asked`` gives another value than ``stored`` holds."""
    return [
        f"{key.replace('_', ' ')}: run has {getattr(stored, key, None)}, asked for {v}"
        for key in keys
        if (v := asked.get(key)) is not None and v != getattr(stored, key, None)
    ]


def differences(stored: JobSpec, asked: dict) -> list[str]:
    """Compare what a resume asks for with the stored spec; one line per difference.

    ``asked`` holds only what the operator gave: ``model`` (a ModelIdentity), ``tokenizer``,
    ``layers``, ``dtype``, ``max_length``, ``batch_tokens``, ``shard_size``, ``data`` (DataFiles),
    ``backend``, ``packed``, ``compiled``, ``codec``, ``parallel``, ``quantized_compute``, ``expert_slice_gb``,
    ``template_kwargs``, ``column``, ``split`` and ``limit`` (asked without ``data``; with it, the data's own),
    ``fidelity_stride``, ``teacher`` (a ``TeacherSpec``).
    """
    out = []
    if (m := asked.get("model")) is not None:
        out += [f"model: {d}" for d in stored.model.fingerprint.differences(m.fingerprint)]
        if "quantization" in stored.model.model_fields_set and m.quantization != stored.model.quantization:
            have, ask = stored.model.quantization or "none", m.quantization or "none"
            out.append(f"model: quantization: run has {have}, asked for {ask}")
    if (t := asked.get("tokenizer")) is not None:
        if t.digest != stored.tokenizer.digest:
            out.append("tokenizer: vocabulary or special tokens differ")
        if t.chat_template != stored.tokenizer.chat_template:
            out.append("chat template differs")
    out += setting_differences(stored, asked, SETTINGS)
    if (v := asked.get("teacher")) is not None:
        have = getattr(stored, "teacher", None)
        if have is None or not have.same_choice(v):
            out.append(f"teacher: the run stores {have or 'no teacher'}, asked for {v}")
    if (v := asked.get("fidelity_stride")) is not None:
        have = getattr(stored, "fidelity", None)
        if have is None or v != have.stride:
            run = "checks no fidelity" if have is None else f"checks 1 in {have.stride} masked tokens"
            out.append(f"fidelity stride: the run {run}, asked for {v}")
    for key in ("split", "limit"):  # asked without --data (with it, the data's own key says it)
        if "data" in asked or (v := asked.get(key)) is None:
            continue
        have = next((getattr(d, key) for d in stored.data if getattr(d, key) is not None), None)
        if v != have:
            read = have if have is not None else "(none given)"
            out.append(f"data: the run read {key} {read}; asked for --{key} {v}")
    column = _named(asked["data"]) if "data" in asked else asked.get("column")
    if ("data" in asked or column is not None) and column != _named(stored.data):
        out.append(
            f"data: the run read each row's turns from {_column(_named(stored.data))}; asked for {_column(column)}"
        )
    if (data := asked.get("data")) is not None and [d.key() for d in stored.data] != [d.key() for d in data]:
        names = ", ".join(d.name for d in data)
        have = ", ".join(d.name for d in stored.data)
        if names != have:
            out.append(f"data: {names} differ from the run's data ({have}) in content, order, split or limit")
        elif (
            getattr(stored, "generate_spec", None) is not None
        ):  # the same generate run, which lost or rewrote a conversation this run planned
            then, now = stored.data[0].size, data[0].size
            out.append(
                f"data: the conversations of the generate run {have} that this run planned changed since "
                f"({then} files then, {now} of them now, or their bytes differ); an extraction keeps what it "
                "planned as it was: extract the generate run into a new run"
            )
        else:
            out.append(f"data: {have} is not what the run read: it differs in content, order, split or limit")
    return out


def _named(data: list[DataFile]) -> str | None:
    """The ``--column`` the data is read with (one for all its sources)."""
    return next((d.column for d in data if d.column is not None), None)


def _column(name: str | None) -> str:
    """Where the turns of rows are read from, in words."""
    return "'conversations' or 'messages' (no --column)" if name is None else f"the column {name!r} (--column {name})"
