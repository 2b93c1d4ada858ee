"""Training-side reading of an hsx run in plain PyTorch: dataset, length-aware batches, collation.

The dataset reads raw sample files through ``safe_open`` (memory-mapped, no pickle) and decodes
encoded ones (``hsx.store.codec``) to the same tensors, so a trainer sees one kind of sample
whatever the run's codec. By default it serves only files that a ``SEALED`` manifest records (a
shard the extraction finished once), so a trainer never sees a sample that a running or crashed
extraction may still rewrite. A damaged or missing file costs exactly its own sample: every other
one is served, and each one left out is named (a warning, and ``HsxDataset.unavailable``), never
dropped in silence; ``strict`` refuses a run with any. Lengths come from the plan, so batching
needs no file reads. Batches are a function of (lengths, budget, seed, epoch), and every rank
computes the same list and takes its own slice: no communication, same result on any machine.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import threading
import time
import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from hsx import certify
from hsx.consumer import DELETED, LEASE_TIMEOUT, NOT_WRITTEN, READING, ConsumerSpec, RankLease
from hsx.errors import CertifyFailed, ConsumerRefused, Damage, SampleUnavailable
from hsx.plan import Plan, batches_for, load_plan
from hsx.plane import Plane, sample_bound
from hsx.spec import RunSpec, load_spec
from hsx.store import layout
from hsx.store.codec import Codec
from hsx.store.format import TEACHER, BadFile, Expected, check, decode, read_checked
from hsx.store.scan import scan_run
from hsx.store.writer import any_consumed, read_consumed
from hsx.teacher import spread


def read_verified(
    path: Path, sample_id: int, keep_fp8: bool = False, expected: Expected | None = None
) -> dict[str, torch.Tensor]:
    """Read one sample file whole, digest-checked by the store (one read for digest and tensors),
    decoded: ``aux_hidden_states``, ``hidden_states``, ``input_ids``, ``loss_mask`` for any codec
    (``keep_fp8``: an fp8 file's states as stored, with their scales; see ``format.decode_tensors``).
    ``expected``: what its run's files hold (``RunSpec.footprint().files``): another run's is refused."""
    return decode(read_checked(path, sample_id, expected), keep_fp8)


def read_mapped(
    path: Path, sample_id: int, keep_fp8: bool = False, expected: Expected | None = None
) -> dict[str, torch.Tensor]:
    """Read a raw sample through a memory map after the cheap check (header, size, id). An encoded
    one is read whole and digest-checked before it is decoded: its bytes are copied out anyway, and
    hashing costs a small part of decoding, so damaged bytes never reach a decoder."""
    from safetensors import safe_open

    if check(path, sample_id, deep=False, expected=expected).codec is not Codec.RAW:
        return read_verified(path, sample_id, keep_fp8, expected)
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a Mapping


class SamplesUnavailableWarning(UserWarning):
    """Some of a run's samples are not served (``HsxDataset.unavailable`` names each)."""


@dataclass
class Availability:
    """Which of a run's samples a reader can serve: ``ids`` with a good file, and every other id of
    the plan with why not (``unavailable``: id -> "kind: detail", kind being a ``Damage`` or
    ``unsealed``)."""

    ids: list[int] = field(default_factory=list)
    unavailable: dict[int, str] = field(default_factory=dict)

    def summary(self, limit: int = 5) -> str:
        """One line: how many of each kind, with their first ids."""
        by_kind: dict[str, list[int]] = defaultdict(list)
        for sid, reason in sorted(self.unavailable.items()):
            by_kind[reason.split(":", 1)[0]].append(sid)
        return "; ".join(
            f"{len(ids)} {kind} (id{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids[:limit]))}"
            f"{', ...' if len(ids) > limit else ''})"
            for kind, ids in sorted(by_kind.items())
        )


def available_ids(
    run: Path, spec: RunSpec, sealed_only: bool = True, threads: int = 8, deep: bool = False
) -> Availability:
    """Every id with a good file (cheap check, or ``deep``: its digest too), and why each other one
    is left out. ``sealed_only``: only files a SEALED manifest records (the scan already refuses a
    file that differs from its shard's manifest); a shard without one is still being written."""
    scans = scan_run(
        run, spec.plan.num_samples, spec.shard_size, deep=deep, threads=threads, want=spec.footprint().files
    )
    out = Availability()
    for s in scans:
        if sealed_only and s.manifest is None:
            why = "its SEALED manifest is unreadable" if s.manifest_unreadable else "not finished by the extraction"
            out.unavailable |= dict.fromkeys(s.expected, f"unsealed: shard {s.shard:06d} is {why}")
            continue
        out.ids += s.good
        out.unavailable |= {
            sid: f"consumed: deleted once every consumer released it ({layout.consumed_record(run, s.shard).name})"
            for sid in s.consumed
            if sid in s.expected and sid not in s.good
        }
        found = {p.sample_id: p for p in s.problems if p.sample_id in s.expected}
        for sid in s.missing:
            p = found.get(sid)
            out.unavailable[sid] = (
                f"{p.kind}: {p.path} ({p.detail})"
                if p is not None
                else f"{Damage.MISSING}: {layout.sample_path(run, sid, spec.shard_size).relative_to(run)}"
            )
    out.ids.sort()
    return out


def certified(run: Path, spec: RunSpec, allow_failed: bool) -> None:
    """Refuse a run whose certificate records a failed check of its numbers (``hsx.certify``), or
    whose certificate was edited or is another run's, unless ``allow_failed``."""
    if allow_failed:
        return
    cert = certify.read_certificate(run)
    if cert is not None and cert.verdict == "failed":
        raise CertifyFailed(
            f"{run}: its certificate records a failed check ({'; '.join(cert.failures)}): its states may not be "
            "the target's. Find the cause (hsx status, hsx verify --reference), or pass allow_failed=True to read it"
        )


class HsxDataset(Dataset):
    """A run's samples as dicts of tensors: ``input_ids`` and ``loss_mask`` int64 [T],
    ``aux_hidden_states`` [T, L*H] (absent where the run has no taps: ``--layers mtp``),
    ``hidden_states`` [T, H] (after the final norm, or before it where ``final_norm`` says
    ``pre``: the run's ``--final-state``), ``sample_id``; a ``--teacher`` run's ``store.format.TEACHER``
    tensors, one row per masked position (``collate_padded``/``collate_packed`` place them by position).

    ``ids`` restricts (and orders) the samples; by default every sample with a good file (header
    and size checked; ``deep``: its digest too, one parallel pass over the run before serving)
    that a SEALED manifest records (``sealed_only``). Each sample left out is in ``unavailable``
    (id -> reason) and a ``SamplesUnavailableWarning`` names them; ``strict`` refuses the run
    instead (``SampleUnavailable``). ``verify`` checks each file's digest as it is read (one read,
    no second pass): a file damaged since raises ``SampleUnavailable`` naming it, never another
    sample in its place. Encoded files are always checked. ``keep_fp8``: for a run stored as fp8,
    the states come as stored, float8_e4m3fn, with ``aux_hidden_states_scale`` [T, L] and
    ``hidden_states_scale`` [T, 1] beside them (``hsx.store.codec.dequantize`` gives the model's
    dtype back, on any device).
    """

    def __init__(
        self,
        run: str | Path,
        ids: Sequence[int] | None = None,
        verify: bool = False,
        sealed_only: bool = True,
        keep_fp8: bool = False,
        strict: bool = False,
        deep: bool = False,
        allow_failed: bool = False,
    ):
        self.run = Path(run)
        self.spec = load_spec(self.run)
        certified(self.run, self.spec, allow_failed)
        self.plan = Plan(self.run, self.spec.plan.parts)
        self.verify = verify
        self.keep_fp8 = keep_fp8
        self.layers = list(self.spec.layers)
        self.final_norm = self.spec.final_norm  # "post" or "pre": the norm of ``hidden_states``
        self.files = self.spec.footprint().files  # what each file must say of itself (another run's is refused)
        self.unavailable: dict[int, str] = {}  # id -> why it is not served (ids given: not looked at)
        if ids is None:
            found = available_ids(self.run, self.spec, sealed_only, deep=deep)
            ids, self.unavailable = found.ids, found.unavailable
            if found.unavailable:
                what = (
                    f"{self.run}: {len(found.unavailable)} of {len(self.plan)} samples are not served: "
                    f"{found.summary()}. hsx extract --out {self.run} redoes them (and finishes unsealed shards)"
                )
                if strict:
                    raise SampleUnavailable(f"{what}; strict refuses a run with any (drop it to train on the rest)")
                warnings.warn(f"{what}; HsxDataset.unavailable names each", SamplesUnavailableWarning, stacklevel=2)
        else:
            bad = [i for i in ids if not 0 <= i < len(self.plan)]
            if bad:
                raise SampleUnavailable(f"ids outside the plan (0..{len(self.plan) - 1}): {bad[:5]}")
        self.ids = list(ids)
        self.lengths = self.plan.lengths[self.ids] if self.ids else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def path(self, sample_id: int) -> Path:
        return layout.sample_path(self.run, sample_id, self.spec.shard_size)

    def __getitem__(self, index: int) -> dict:
        sid = self.ids[index]
        return load_sample(self.run, self.path(sid), sid, self.files, self.verify, self.keep_fp8)


def load_sample(
    run: Path,
    path: Path,
    sid: int,
    expected: Expected | None,
    verify: bool = True,
    keep_fp8: bool = False,
    plane: Plane | None = None,
) -> dict:
    """One sample as every reader of a run serves it (``HsxDataset``, ``StreamDataset``): its file's
    tensors, decoded, ids and mask as int64, with its ``sample_id``; ``SampleUnavailable`` names a
    missing or bad file (``verify``: its digest checked in the same read), or another run's
    (``expected``: what the run's files hold). ``plane``: the file's bytes from the run's data plane
    (``hsx.plane``), checked as a file's are, instead of its path."""
    where = path if plane is None else f"its key {plane.key(sid)} in {plane}"
    try:
        if plane is not None:
            t = decode(plane.read(sid, expected), keep_fp8)
        else:
            read = read_verified if verify else read_mapped
            t = read(path, sid, keep_fp8, expected)
    except FileNotFoundError as e:
        raise SampleUnavailable(f"sample {sid}: {where} is missing; redo it with hsx extract --out {run}") from e
    except BadFile as e:
        raise SampleUnavailable(f"sample {sid}: {where} is {e}; redo it with hsx extract --out {run}") from e
    return {
        "sample_id": sid,
        "input_ids": t["input_ids"].to(torch.int64),
        "loss_mask": t["loss_mask"].to(torch.int64),
        **{k: t[k] for k in (*STATE_KEYS, *TEACHER) if k in t},
    }


STATE_KEYS = ("aux_hidden_states", "hidden_states", "aux_hidden_states_scale", "hidden_states_scale")


def _per_token(sample: dict) -> dict:
    """A sample's teacher rows (one per masked position) spread over its tokens, zeros elsewhere."""
    return {k: spread(sample[k], sample["loss_mask"]) for k in TEACHER if k in sample}


# ---------------------------------------------------------------- batching and sharding


class LengthBatchSampler(Sampler[list[int]]):
    """Batches of similar length within a token budget, shuffled per epoch, split across ranks.

    Every rank builds the same batch list from (lengths, max_tokens, seed, epoch) and takes every
    ``world_size``-th batch starting at ``rank``. The list is padded by repeating its first batches
    (or cut, ``drop_last``) so all ranks run the same number of steps.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        packed: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        order = range(len(lengths))  # the plan's own batching: longest first, within the budget
        self.batches = [list(b.ids) for b in batches_for(order, np.asarray(lengths), max_tokens, packed)]
        if len(self.batches) < world_size and not drop_last:
            raise ValueError(f"{len(self.batches)} batches cannot feed {world_size} ranks; lower max_tokens")
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _all(self) -> list[list[int]]:
        batches = list(self.batches)
        if self.shuffle:
            _shuffle(batches, self.seed, self.epoch)
        extra = len(batches) % self.world_size
        if self.drop_last:
            return batches[: len(batches) - extra]
        if extra:
            batches += batches[: self.world_size - extra]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._all()[self.rank :: self.world_size])

    def __len__(self) -> int:
        n = len(self.batches)
        return (n // self.world_size) if self.drop_last else -(-n // self.world_size)


def _shuffle(batches: list[list[int]], seed: int, salt: int) -> None:
    """A batch order fixed by (seed, salt): an epoch's, or a shard's in a stream."""
    random.Random(seed * 1_000_003 + salt).shuffle(batches)


def shard_indices(n: int, rank: int, world_size: int, seed: int | None = None) -> list[int]:
    """Sample-level split for ranks: a (seeded) permutation of 0..n-1, every ``world_size``-th item."""
    order = list(range(n))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return order[rank::world_size]


# ---------------------------------------------------------------- collation


def collate_padded(samples: list[dict], pad_id: int = 0) -> dict:
    """Right-padded batch: ``input_ids``/``loss_mask``/``attention_mask`` [B, T], states [B, T, *];
    a ``--teacher`` run's rows at their masked positions, [B, T, *] (zeros where ``loss_mask`` is 0)."""
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples], dtype=torch.int64)
    T, B = int(lengths.max()), len(samples)
    samples = [s | _per_token(s) for s in samples]
    first = samples[0]
    states = [k for k in (*STATE_KEYS, *TEACHER) if k in first]
    out = {
        "input_ids": torch.full((B, T), pad_id, dtype=torch.int64),
        "loss_mask": torch.zeros(B, T, dtype=torch.int64),
        "attention_mask": torch.zeros(B, T, dtype=torch.int64),
        **{k: first[k].new_zeros(B, T, *first[k].shape[1:]) for k in states},
    }
    for b, s in enumerate(samples):
        n = int(lengths[b])
        out["attention_mask"][b, :n] = 1
        for k in ("input_ids", "loss_mask", *states):
            out[k][b, :n] = s[k]
    out["lengths"] = lengths
    out["sample_ids"] = torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64)
    return out


def collate_packed(samples: list[dict]) -> dict:
    """All samples in one row [1, sum T], no padding: ``position_ids`` restart per sample,
    ``document_ids`` give each token's sample (0..B-1), ``cu_seqlens`` [B+1] int32 for varlen attention;
    a ``--teacher`` run's rows at their masked positions, [1, sum T, *] (zeros elsewhere)."""
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples], dtype=torch.int64)
    samples = [s | _per_token(s) for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
        "loss_mask": torch.cat([s["loss_mask"] for s in samples])[None],
        **{k: torch.cat([s[k] for s in samples])[None] for k in (*STATE_KEYS, *TEACHER) if k in samples[0]},
        "position_ids": torch.cat([torch.arange(int(n)) for n in lengths])[None],
        "document_ids": torch.repeat_interleave(torch.arange(len(samples)), lengths)[None],
        "cu_seqlens": cu,
        "lengths": lengths,
        "sample_ids": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64),
    }


# ---------------------------------------------------------------- a live run, streamed


def stream_batches(lengths: np.ndarray, shard_size: int, max_tokens: int, packed: bool, seed: int) -> list[list[int]]:
    """A consumer's whole sequence of batches: shard by shard, in the order an extraction writes
    them, each shard's samples batched as ``LengthBatchSampler`` batches them (longest first within
    ``max_tokens``) and its batches in an order fixed by (seed, shard). A batch never spans two
    shards, so a consumer waits on one shard at a time and a producer's window never has to hold
    more than the shard being written for it to go on."""
    out: list[list[int]] = []
    for shard in range(layout.num_shards(len(lengths), shard_size)):
        ids = layout.shard_ids(shard, shard_size, len(lengths))
        batches = [list(b.ids) for b in batches_for(ids, lengths, max_tokens, packed)]
        _shuffle(batches, seed, shard)
        out += batches
    return out


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StreamDataset(IterableDataset):
    """A live run's verified samples, as they land, for one rank of a named consumer: batches of
    the dicts ``HsxDataset`` gives, collated by ``collate`` (``collate_padded``, ``collate_packed``
    or the trainer's own), each sample handed out only once its digest verified.

    The batches are the consumer's sequence (``stream_batches``; rank ``rank`` of ``ranks`` takes
    every ``ranks``-th), the same on every restart, so ranks are disjoint and a restart continues
    exactly where its checkpoint stood. Each batch handed out is leased to the rank until the
    trainer acknowledges it: ``ack(step)`` after each optimizer step (before saving that step's
    checkpoint), ``checkpointed(step)`` once a checkpoint is durable. A trainer resumed from its
    checkpoint at step S passes ``resume_step=S``: the stream continues right after what was
    acknowledged at S (a step never acknowledged is refused by name, ``ConsumerRefused``).

    A sample not written yet is waited for (``poll`` seconds between looks; ``hsx status`` shows
    what each rank waits for); a file that does not verify is waited for too, named in the log,
    until ``hsx extract --out`` redoes it: never skipped. ``plane``: a run extracted with ``--plane``
    is read from its data plane (``hsx.plane``: its URL), and ``run`` needs only the records (spec,
    plan, ``consumers/``), shared with the producer, not the sample files. Reads run ahead by ``prefetch`` batches
    on ``threads`` threads of the stream's own, so the DataLoader around it runs no workers
    (``num_workers=0``, ``batch_size=None``). Records: ``hsx.consumer``; a rank whose acks log is
    damaged is refused (``RecordDamaged``) unless resumed from a step before the damage, or, with
    ``rebuild_acks``, from one past it: the damaged lines are rebuilt from the sequence."""

    def __init__(
        self,
        run: str | Path,
        consumer: str,
        rank: int = 0,
        ranks: int = 1,
        max_tokens: int = 16384,
        packed: bool = False,
        seed: int = 0,
        resume_step: int | None = None,
        collate: Callable[[list[dict]], object] = collate_padded,
        lease_timeout: float = LEASE_TIMEOUT,
        prefetch: int = 2,
        threads: int = 4,
        keep_fp8: bool = False,
        poll: float = 0.2,
        log: Callable[[str], None] = _stderr,
        allow_failed: bool = False,
        plane: str | None = None,
        rebuild_acks: bool = False,
    ):
        self.run = Path(run)
        self.spec = load_spec(self.run)
        self.files = self.spec.footprint().files
        certified(self.run, self.spec, allow_failed)
        window = self.spec.window
        self.plane = None if plane is None else _plane(self.run, self.spec, consumer, plane)
        if window is not None and window.delete and consumer not in window.consumers and any_consumed(self.run):
            raise ConsumerRefused(
                f"{self.run} deletes the samples its window's consumers ({', '.join(window.consumers)}) released, "
                f"and has deleted some: consumer {consumer} would wait for them forever"
            )
        self.plan = load_plan(self.run, self.spec)
        order = stream_batches(self.plan.lengths, self.spec.shard_size, max_tokens, packed, seed)
        self.batches = order[rank::ranks]
        self.collate, self.keep_fp8, self.poll, self.log = collate, keep_fp8, poll, log
        self.prefetch, self.threads = prefetch, threads
        asked = ConsumerSpec(name=consumer, ranks=ranks, seed=seed, max_tokens=max_tokens, packed=packed)
        rebuild = self.batches if rebuild_acks else None
        self.lease = RankLease(self.run, asked, rank, resume_step, lease_timeout, log, rebuild).start()
        self._why: dict[int, str] = {}  # sample id -> why its read waits
        self._stop = threading.Event()

    def __len__(self) -> int:
        """Batches of this rank's whole sequence (those before ``resume_step`` included)."""
        return len(self.batches)

    @property
    def position(self) -> int:
        """Batches handed out so far, of ``len(self)``."""
        return self.lease.position

    def _read(self, sid: int) -> dict:
        """The sample once its file is there and verifies; ``ConsumerRefused`` where the run deleted it
        as consumed (every consumer its window names released it: this one would wait forever)."""
        path = layout.sample_path(self.run, sid, self.spec.shard_size)
        while not self._stop.is_set():
            try:
                sample = load_sample(self.run, path, sid, self.files, True, self.keep_fp8, self.plane)
                self._why.pop(sid, None)
                return sample
            except SampleUnavailable as e:
                missing = isinstance(e.__cause__, FileNotFoundError)
                if missing and sid in read_consumed(self.run, layout.shard_of(sid, self.spec.shard_size)):
                    self._deleted(sid)
                why = NOT_WRITTEN if missing else str(e)
                if why != self._why.get(sid) and why != NOT_WRITTEN:
                    self.log(f"consumer {self.lease.spec.name}: {why}; waiting for it")
                self._why[sid] = why
            time.sleep(self.poll)
        raise SampleUnavailable(f"sample {sid}: the stream was closed while waiting for it")

    def _deleted(self, sid: int) -> None:
        """Refuse a sample the run deleted as consumed, recorded as what the rank waits for (status names it)."""
        window = self.spec.window
        named = ", ".join(window.consumers) if window is not None else "none"
        why = self._why[sid] = f"{DELETED} once the consumers the run's window names ({named}) released it"
        self.lease.waiting(sid, why)
        raise ConsumerRefused(
            f"consumer {self.lease.spec.name}: sample {sid} was {why}; this consumer would wait for it forever: "
            "read a run that deletes nothing, or name the consumer in the --window of a new run"
        )

    def __iter__(self) -> Iterator:
        if get_worker_info() is not None:
            raise RuntimeError("a StreamDataset reads ahead on its own threads: use DataLoader(num_workers=0)")
        ahead: deque[tuple[list[int], list[Future]]] = deque()
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hsx-stream")
        upcoming = iter(self.batches[self.lease.position :])
        try:
            while True:
                for ids in itertools.islice(upcoming, self.prefetch + 1 - len(ahead)):
                    ahead.append((ids, [pool.submit(self._read, sid) for sid in ids]))
                if not ahead:
                    return
                ids, reads = ahead.popleft()
                samples = []
                for sid, read in zip(ids, reads, strict=True):
                    while not read.done():  # what it waits for, kept current (a producer's window reads it)
                        self.lease.waiting(sid, self._why.get(sid, READING))
                        wait([read], timeout=self.poll)
                    samples.append(read.result())
                self.lease.waiting(None)
                self.lease.handed(ids)
                yield self.collate(samples)
        finally:
            self._stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            self._stop.clear()

    def ack(self, step: int) -> list[int]:
        """Acknowledge, durably, every batch handed out since the last acknowledgement, at optimizer
        step ``step`` (steps only grow); returns their sample ids."""
        return self.lease.ack(step)

    def checkpointed(self, step: int) -> None:
        """The trainer's checkpoint of ``step`` is durable: the samples acknowledged through it are
        released (a producer's ``--window`` may delete them)."""
        self.lease.checkpointed(step)

    def close(self) -> None:
        """Give the rank's lease back (what is handed out and unacknowledged returns to the stream)."""
        self.lease.close()
        if self.plane is not None:
            self.plane.close()

    def __enter__(self) -> StreamDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plane(run: Path, spec: RunSpec, consumer: str, url: str) -> Plane:
    """The run's data plane for ``consumer``, refused by name where the run puts nothing there, or
    where the consumer is not one its window waits for (its keys leave once those released them)."""
    window = spec.window
    if window is None or window.plane is None:
        raise ConsumerRefused(f"{run} was extracted without --plane: its samples are files only, never in {url}")
    if consumer not in window.consumers:
        raise ConsumerRefused(
            f"consumer {consumer}: the plane holds a sample until the consumers {run}'s window names "
            f"({', '.join(window.consumers)}) released it; this one would wait for samples gone: "
            "name it in the --window of a new run"
        )
    return Plane(url, run, sample_bound(spec))


def describe(run: str | Path) -> dict:
    """What a trainer needs to size its model from a run, without opening a sample file.
    ``num_samples`` is the plan's; ``len(HsxDataset(run))`` is how many are served now. ``teacher``:
    what a ``--teacher`` run stores at each masked position (``kind`` and ``k`` or ``vocab_size``)."""
    spec = load_spec(Path(run))
    teacher = None if spec.teacher is None else json.loads(spec.teacher.label())
    return {
        "hidden_size": spec.model.hidden_size,
        "num_layers": spec.model.num_layers,
        "layers": list(spec.layers),
        "final_norm": spec.final_norm,
        "dtype": spec.dtype,
        "num_samples": spec.plan.num_samples,
        "teacher": teacher,
    }
