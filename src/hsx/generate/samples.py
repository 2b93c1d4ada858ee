"""A generate run as extraction's input: samples made of the generated token ids, never re-rendered.

``hsx extract --data GEN`` plans from the conversation files of GEN (``generate.record``), in
conversation id order. The loss mask is exactly the completion tokens: the target's own answers.

- One sample per conversation, the last turn's prompt + completion, where every earlier turn's
  prompt + completion is a prefix of it, token for token (so each answer is in the sample with the
  very context the target produced it in); the mask covers every turn's completion.
- Otherwise (the template dropped reasoning from the history, or wrote another end marker than
  the stop token the target emitted), one sample per turn: its prompt + completion.

A rejected conversation (the generate run said why) and, in an unfinished run, one not generated
yet become the extraction's rejects, with the reason; nothing is dropped silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import xxhash

from hsx.errors import BadFile, HsxError, Refused
from hsx.generate.record import ConversationRecord, read_record
from hsx.generate.spec import GenerateSpec, load_generate_spec
from hsx.input import Reject, Source
from hsx.plan import Sample
from hsx.spec import DataFile
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


def generated(run: Path) -> tuple[GenerateSpec, dict[int, str]]:
    """The generate run's spec and its verified conversation files (id -> digest), headers checked."""
    spec = load_generate_spec(run)
    scans = scan_run(run, spec.plan.num_samples, spec.shard_size, deep=False)
    return spec, {cid: rec.digest for s in scans for cid, rec in sorted(s.good.items())}


def data_file(run: Path) -> DataFile:
    """A generate run as the extraction spec records a data file: its path, its number of
    conversation files, and a digest of its spec and of every file's digest (a resume of the
    extraction against a generate run that changed since is refused by the drift check)."""
    spec, files = generated(run)
    h = xxhash.xxh3_128(spec.digest().encode())
    for cid, digest in files.items():
        h.update(f"{cid}:{digest}\n".encode())
    return DataFile(name=str(run.expanduser().resolve()), size=len(files), digest=h.hexdigest())


def plan_samples(
    run: Path, tokenizer_digest: str, max_length: int, allow_incomplete: bool, log
) -> tuple[GenerateSpec, Iterator[Sample | Reject]]:
    """The samples of a generate run, refused when its tokenizer is not the extraction model's or
    (unless ``allow_incomplete``) when it is not finished."""
    spec, files = generated(run)
    if spec.tokenizer.digest != tokenizer_digest:
        raise Refused(f"{run} was generated with another tokenizer than this model's: its token ids mean other text")
    total = spec.plan.num_samples
    if len(files) < total:
        if not allow_incomplete:
            raise Refused(
                f"{run} is an unfinished generate run ({len(files)} of {total} conversations): finish it "
                f"(hsx generate --out {run}) or extract what is there with --allow-incomplete"
            )
        log(f"extracting an unfinished generate run: {len(files)} of {total} conversations")

    def items() -> Iterator[Sample | Reject]:
        for cid in range(total):
            path = layout.sample_path(run, cid, spec.shard_size)
            if cid not in files:
                yield Reject(Source(str(run), cid, ""), NOT_GENERATED)
                continue
            try:
                rec = read_record(path, cid)
            except (OSError, BadFile) as e:
                yield Reject(Source(str(run), cid, ""), f"conversation file unreadable: {e}")
                continue
            yield from samples_of(rec, run, max_length)

    return spec, items()


def waiting(extraction: Path, gen: Path) -> tuple[int, int]:
    """Of the conversations an extraction of the unfinished generate run ``gen`` found not generated
    (its rejects): how many there were, and how many ``gen`` holds by now."""
    import json

    try:
        lines = (extraction / layout.REJECTS).read_text().splitlines()
    except OSError:
        return 0, 0
    ids = {r["row"] for r in map(json.loads, lines) if r.get("reason") == NOT_GENERATED}
    if not ids:
        return 0, 0
    try:
        _, files = generated(gen)
    except HsxError:  # the generate run is gone or unreadable: none can be counted as there
        return len(ids), 0
    return len(ids), len(ids & files.keys())
