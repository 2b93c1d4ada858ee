"""Plan stage: conversations -> the frozen, tokenized work list that a run extracts.

The chat template of the target's own tokenizer renders each conversation. The loss mask marks
every assistant turn's content and its end-of-turn token; it is derived from the rendering alone,
by rendering prefixes, so templates without ``{% generation %}`` markers work:

    before = render(turns[:i], add_generation_prompt=True)   # ends where turn i's content starts
    after  = render(turns[:i+1])                              # ends after its end-of-turn marker
    mask the tokens in [len(before), len(after.rstrip()))     # trailing newlines are not the turn's

The plan is written once into ``OUT/plan/plan.parquet`` with its fingerprint (a digest of the
token content, not of the file bytes). Sample id = row index in the plan. Resume reads only this.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from hsx.errors import PlanError
from hsx.input import Conversation, Reject
from hsx.store.layout import PLAN_DIR, PLAN_FILE

PLAN_META = "plan.json"

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("truncated", pa.bool_()),
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("source_id", pa.string()),
    ]
)


class NoUsableSamples(PlanError):
    """Every row was rejected: ``rejects`` says why, for the caller to write where its message says."""

    def __init__(self, rejects: list[Reject]):
        super().__init__(
            f"no usable samples: all {len(rejects)} rows were rejected"
            if rejects
            else "no usable samples: the data holds no rows"
        )
        self.rejects = rejects


class TemplateError(ValueError):
    """The chat template cannot be used to derive loss masks for this conversation."""


@dataclass(frozen=True)
class Sample:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # int8 [T]
    truncated: bool
    source_file: str
    source_row: int
    source_id: str


class Tokenize:
    """Render with the tokenizer's chat template and derive the assistant-token mask."""

    def __init__(self, tokenizer, max_length: int, template_kwargs: dict | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise TemplateError("hsx needs a fast (Rust) tokenizer: it maps tokens to characters by offsets")
        if not tokenizer.chat_template:
            raise TemplateError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.template_kwargs = dict(template_kwargs or {})  # e.g. enable_thinking, passed to the template

    def render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def ids(self, text: str) -> list[int]:
        """A rendered text's token ids, as the plan tokenizes it (the template writes its own specials)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the character spans of each assistant turn (content + end marker)."""
        full = self.render(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], True)
            after = self.render(messages[: i + 1], False)
            if not (full.startswith(after) and after.startswith(before)):
                raise TemplateError(f"chat template is not prefix-stable at turn {i}")
            end = len(after.rstrip())
            if end > len(before):
                spans.append((len(before), end))
        return full, spans

    def __call__(self, conv: Conversation) -> Sample:
        messages = [{"role": t.role, "content": t.content} for t in conv.turns]
        text, spans = self.spans(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.int8)
        for lo, hi in spans:
            mask[(starts >= lo) & (starts < hi)] = 1
        truncated = len(ids) > self.max_length
        if truncated:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if len(ids) == 0:
            raise TemplateError("renders to no tokens")
        if not mask.any():
            raise TemplateError(
                f"no assistant token within the first {self.max_length} tokens"
                if truncated
                else "no assistant token after rendering"
            )
        src = conv.source
        return Sample(ids, mask, truncated, src.file, src.row, src.id)


def tokenize_all(items: Iterable[Conversation | Reject], tokenize: Tokenize) -> Iterator[Sample | Reject]:
    for item in items:
        if isinstance(item, Reject):
            yield item
            continue
        try:
            yield tokenize(item)
        except Exception as e:  # a template error on one row must not stop the run
            yield Reject(item.source, f"tokenization failed: {e}")


class PlanBuilder:
    """Streams samples into a Parquet file and computes the plan fingerprint on the way."""

    def __init__(self, path: Path, rows_per_group: int = 4096):
        self.path = path
        self.writer = pq.ParquetWriter(path, SCHEMA, compression="zstd")
        self.rows: list[Sample] = []
        self.rows_per_group = rows_per_group
        self.hash = xxhash.xxh3_128()
        self.num_samples = 0
        self.num_tokens = 0

    def add(self, sample: Sample) -> None:
        self.hash.update(_sample_digest_input(self.num_samples, sample.input_ids, sample.loss_mask))
        self.num_samples += 1
        self.num_tokens += len(sample.input_ids)
        self.rows.append(sample)
        if len(self.rows) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if not self.rows:
            return
        cols = {
            "input_ids": [r.input_ids for r in self.rows],
            "loss_mask": [r.loss_mask for r in self.rows],
            "truncated": [r.truncated for r in self.rows],
            "source_file": [r.source_file for r in self.rows],
            "source_row": [r.source_row for r in self.rows],
            "source_id": [r.source_id for r in self.rows],
        }
        self.writer.write_table(pa.table(cols, schema=SCHEMA))
        self.rows = []

    def close(self) -> str:
        self._flush()
        self.writer.close()
        return self.hash.hexdigest()


def _sample_digest_input(sample_id: int, ids: np.ndarray, mask: np.ndarray) -> bytes:
    ids = np.ascontiguousarray(ids, dtype="<i4")
    mask = np.ascontiguousarray(mask, dtype="i1")
    return sample_id.to_bytes(8, "little") + len(ids).to_bytes(8, "little") + ids.tobytes() + mask.tobytes()


@dataclass(frozen=True)
class PlanInfo:
    fingerprint: str
    num_samples: int
    num_tokens: int
    num_truncated: int
    max_length: int


class Plan:
    """The frozen plan of a run, held in memory (ids and masks are small next to hidden states)."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / PLAN_DIR
        table = pq.read_table(self.dir / PLAN_FILE)
        self.info = PlanInfo(**json.loads((self.dir / PLAN_META).read_text()))
        self._ids = table.column("input_ids").combine_chunks()
        self._mask = table.column("loss_mask").combine_chunks()
        self.truncated = table.column("truncated").to_numpy(zero_copy_only=False)
        self.sources = table.select(["source_file", "source_row", "source_id"])
        self.lengths = np.diff(self._ids.offsets.to_numpy()).astype(np.int64)
        self._ids_flat = self._ids.values.to_numpy()
        self._mask_flat = self._mask.values.to_numpy()
        self._offsets = self._ids.offsets.to_numpy()

    def __len__(self) -> int:
        return len(self.lengths)

    def input_ids(self, i: int) -> np.ndarray:
        return self._ids_flat[self._offsets[i] : self._offsets[i + 1]]

    def loss_mask(self, i: int) -> np.ndarray:
        return self._mask_flat[self._offsets[i] : self._offsets[i + 1]]

    def fingerprint(self) -> str:
        """Recompute the fingerprint from the stored tokens (detects a tampered or damaged plan)."""
        h = xxhash.xxh3_128()
        for i in range(len(self)):
            h.update(_sample_digest_input(i, self.input_ids(i), self.loss_mask(i)))
        return h.hexdigest()


def write_plan(run_dir: Path, samples: Iterable[Sample | Reject], max_length: int) -> tuple[PlanInfo, list[Reject]]:
    """Write the plan once; rejects are returned for the caller to record."""
    plan_dir = run_dir / PLAN_DIR
    plan_dir.mkdir(parents=True, exist_ok=True)
    tmp = plan_dir / f".{PLAN_FILE}.tmp-{os.getpid()}"
    builder = PlanBuilder(tmp)
    rejects: list[Reject] = []
    truncated = 0
    try:
        for item in samples:
            if isinstance(item, Reject):
                rejects.append(item)
            else:
                builder.add(item)
                truncated += item.truncated
        fingerprint = builder.close()
        if builder.num_samples == 0:
            raise NoUsableSamples(rejects)
    except BaseException:  # an unreadable file, no usable row, Ctrl-C: no half-written plan stays behind
        builder.writer.close()
        tmp.unlink(missing_ok=True)
        raise
    from hsx.store.durable import durable_rename, write_durable

    durable_rename(tmp, plan_dir / PLAN_FILE)
    info = PlanInfo(fingerprint, builder.num_samples, builder.num_tokens, truncated, max_length)
    write_durable(plan_dir / PLAN_META, json.dumps(info.__dict__, indent=1).encode())
    return info, rejects


@dataclass(frozen=True)
class Batch:
    """Sample ids processed by one forward pass, longest first."""

    ids: tuple[int, ...]
    max_len: int
    tokens: int  # real tokens

    @property
    def padded_tokens(self) -> int:
        return len(self.ids) * self.max_len


def batches_for(ids: Iterable[int], lengths: np.ndarray, budget: int, packed: bool = False) -> list[Batch]:
    """Group ids (one shard's) by length, longest first, into batches within ``budget`` tokens.

    The budget counts padded tokens (rows x longest), or real tokens when ``packed``. A sample
    longer than the budget gets a batch of its own. Deterministic in (ids, lengths, budget,
    packed): a resume recomputes a sample in exactly the batch an uninterrupted run would have
    used, so the tensors are bit-identical (invariant 7).
    """
    order = sorted(ids, key=lambda i: (-int(lengths[i]), i))
    out: list[Batch] = []
    cur: list[int] = []
    cur_max = total = 0
    for i in order:
        n = int(lengths[i])
        cost = total + n if packed else (len(cur) + 1) * cur_max
        if cur and cost > budget:
            out.append(Batch(tuple(cur), cur_max, total))
            cur, total = [], 0
        if not cur:
            cur_max = n
        cur.append(i)
        total += n
    if cur:
        out.append(Batch(tuple(cur), cur_max, total))
    return out


def load_plan(run: Path, spec) -> Plan:
    """The run's plan, refused unless it matches the spec's fingerprint (ids and masks come from it)."""
    try:
        plan = Plan(run)
    except (OSError, ValueError) as e:
        raise PlanError(f"the plan in {run / PLAN_DIR} is unreadable ({e})") from e
    if len(plan) != spec.plan.num_samples or plan.fingerprint() != spec.plan.fingerprint:
        raise PlanError(f"the plan in {run / PLAN_DIR} does not match the run spec's fingerprint")
    return plan
