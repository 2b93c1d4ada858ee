"""A generate run as extraction's input: samples made of the generated token ids, never re-rendered.

``hsx extract --data GEN`` plans from the conversation files of GEN (``genrun.record``), in
conversation id order. The loss mask is exactly the completion tokens: the target's own answers.

- One sample per conversation, the last turn's prompt + completion, where every earlier turn's
  prompt + completion is a prefix of it, token for token (so each answer is in the sample with the
  very context the target produced it in); the mask covers every turn's completion.
- Otherwise (the template dropped reasoning from the history, or wrote another end marker than
  the stop token the target emitted), one sample per turn: its prompt + completion.

A rejected conversation (the generate run said why) and, in an unfinished run, one not generated
yet become the extraction's rejects, with the reason; nothing is dropped silently. A resume of the
extraction plans those generated since (``extract.follow``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from hsx.errors import BadFile, HsxError, Refused
from hsx.genrun.record import ConversationRecord, read_record
from hsx.genrun.spec import GenerateSpec, load_generate_spec
from hsx.input import Reject, Source, read_rejects
from hsx.plan import Sample
from hsx.spec import DataFile, plan_growth
from hsx.store import layout
from hsx.store.scan import scan_run

NOT_GENERATED = "not generated (the generate run is unfinished)"


def whole(rec: ConversationRecord) -> bool:
    """Every earlier turn's prompt + completion is a prefix of the last turn's."""
    last = rec.turns[-1]
    seq = np.concatenate([last.prompt_ids, last.completion_ids])
    for t in rec.turns[:-1]:
        n, m = len(t.prompt_ids), len(t.completion_ids)
        if n + m > len(seq) or not (
            np.array_equal(seq[:n], t.prompt_ids) and np.array_equal(seq[n : n + m], t.completion_ids)
        ):
            return False
    return True


def _sample(ids: np.ndarray, spans: list[tuple[int, int]], max_length: int, src: Source) -> Sample | Reject:
    mask = np.zeros(len(ids), dtype=np.int8)
    for lo, hi in spans:
        mask[lo:hi] = 1
    truncated = len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not mask.any():
        return Reject(src, f"no completion token within the first {max_length} tokens")
    return Sample(np.ascontiguousarray(ids, dtype=np.int32), mask, truncated, src.file, src.row, src.id)


def samples_of(rec: ConversationRecord, run: Path, max_length: int) -> Iterator[Sample | Reject]:
    src = Source(str(run), rec.id, rec.key)
    if not rec.ok:
        yield Reject(src, f"rejected by hsx generate: {rec.reason}")
        return
    if not rec.turns:
        yield Reject(src, "no generated turn")
        return
    if whole(rec):
        last = rec.turns[-1]
        ids = np.concatenate([last.prompt_ids, last.completion_ids])
        spans = []
        for t in rec.turns:
            spans.append((len(t.prompt_ids), len(t.prompt_ids) + len(t.completion_ids)))
        yield _sample(ids, spans, max_length, src)
        return
    for k, t in enumerate(rec.turns):
        ids = np.concatenate([t.prompt_ids, t.completion_ids])
        turn_src = Source(src.file, src.row, f"{rec.key}/turn{k}")
        yield _sample(ids, [(len(t.prompt_ids), len(ids))], max_length, turn_src)


@dataclass(frozen=True)
class GeneratedRun:
    """A generate run as extraction reads it: its spec and its verified conversation files (id ->
    digest), listed once, so what is planned and what is recorded of it come from one listing."""

    path: Path
    spec: GenerateSpec
    files: dict[int, str]

    @classmethod
    def read(cls, run: Path) -> GeneratedRun:
        spec = load_generate_spec(run)
        scans = scan_run(run, spec.plan.num_samples, spec.shard_size, deep=False)
        return cls(run, spec, {cid: rec.digest for s in scans for cid, rec in sorted(s.good.items())})

    def identity(self, skip: Collection[int] = ()) -> DataFile:
        """The generate run as the extraction spec records a data file: its path, its number of
        conversation files, and a digest of its spec and of every file's digest; ``skip``: the
        conversations an extraction found not generated (it follows them, ``extract.follow``), so a
        resume is refused only when a conversation it planned changed."""
        files = {cid: d for cid, d in self.files.items() if cid not in skip}
        h = xxhash.xxh3_128(self.spec.digest().encode())
        for cid, digest in files.items():
            h.update(f"{cid}:{digest}\n".encode())
        return DataFile(name=str(self.path.expanduser().resolve()), size=len(files), digest=h.hexdigest())

    def samples(self, cids: Iterable[int], max_length: int) -> Iterator[Sample | Reject]:
        """The samples of conversations ``cids``, in order; one not generated yet is a reject."""
        for cid in cids:
            if cid not in self.files:
                yield Reject(Source(str(self.path), cid, ""), NOT_GENERATED)
                continue
            try:
                rec = read_record(layout.sample_path(self.path, cid, self.spec.shard_size), cid)
            except (OSError, BadFile) as e:
                yield Reject(Source(str(self.path), cid, ""), f"conversation file unreadable: {e}")
                continue
            yield from samples_of(rec, self.path, max_length)


def plan_samples(
    run: Path, tokenizer_digest: str, max_length: int, allow_incomplete: bool, log
) -> tuple[GeneratedRun, Iterator[Sample | Reject]]:
    """The samples of a generate run, refused when its tokenizer is not the extraction model's or
    (unless ``allow_incomplete``) when it is not finished."""
    gen = GeneratedRun.read(run)
    if gen.spec.tokenizer.digest != tokenizer_digest:
        raise Refused(f"{run} was generated with another tokenizer than this model's: its token ids mean other text")
    total = gen.spec.plan.num_samples
    if len(gen.files) < total:
        if not allow_incomplete:
            raise Refused(
                f"{run} is an unfinished generate run ({len(gen.files)} of {total} conversations): finish it "
                f"(hsx generate --out {run}) or extract what is there with --allow-incomplete"
            )
        log(
            f"extracting an unfinished generate run: {len(gen.files)} of {total} conversations "
            "(a resume of this extraction plans the rest as they are generated)"
        )
    return gen, gen.samples(range(total), max_length)


def not_generated(extraction: Path) -> list[int]:
    """The conversations of its generate run an extraction is still waiting for: its growth record's
    (``spec.PlanGrowth``), or before any growth the rows its rejects say were not generated."""
    growth = plan_growth(extraction)
    if growth is not None:
        return growth.waiting
    rows = read_rejects(extraction / layout.REJECTS)
    return sorted({r["row"] for r in rows if r.get("reason") == NOT_GENERATED})


def waiting(extraction: Path, gen: Path) -> tuple[int, int]:
    """Of the conversations an extraction of the unfinished generate run ``gen`` still waits for: how
    many there are, and how many ``gen`` holds by now (the next resume plans them)."""
    ids = set(not_generated(extraction))
    if not ids:
        return 0, 0
    try:
        files = GeneratedRun.read(gen).files
    except HsxError:  # the generate run is gone or unreadable: none can be counted as there
        return len(ids), 0
    return len(ids), len(ids & files.keys())
