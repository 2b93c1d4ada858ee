"""A trainer's records in a run folder: what each rank of a named consumer was handed, what it
acknowledged at which optimizer step, and which step its last durable checkpoint holds.

    OUT/consumers/NAME/
      consumer.json          written once, by the first rank to start: the stream's parameters (ranks,
                             seed, token budget, packing); a start that asks for others is refused by name
      rank-000000.json       rank 0's lease: who holds the rank (host, pid and its start time), its
                             heartbeat, the position in its batch sequence it was handed through, the
                             ids handed and not yet acknowledged (leased), what it waits for; taken
                             and kept fresh as the run lock is (``lock.RunLock``)
      acks-000000.jsonl      rank 0's acknowledgements, one line per optimizer step, appended and
                             fsynced: {"step": S, "batches": B, "ids": [...], "t": time}; B counts
                             the rank's batches acknowledged through S
      checkpoint-000000.json the last step whose trainer checkpoint rank 0 declared durable: what rank 0
                             acknowledged through it is released (each rank declares its own, so one
                             rank's checkpoint never releases another's unsaved steps)

Every rank of a consumer draws from one sequence of batches fixed by the plan and the consumer's
parameters (``hsx.data.stream_batches``): rank r takes every ``ranks``-th, so ranks are disjoint
without talking. A rank restarted from its checkpoint at step S starts right after the batches its
acknowledgement at S covers; its acknowledgements after S are rolled back (their samples are
trained again, nothing acknowledged twice). A resume from a step never acknowledged is refused by
name. A line cut by a crash ends the log (it was never acknowledged: its fsync never returned) and
is cut off by the rank's next start.

consumer.json, each checkpoint, each lease and each line of an acks log are the run's records
(``store.records``: stamped with the run's identity and a digest); a damaged one (truncated,
garbled, another run's; a lease of another rank or consumer copied over) is named, never trusted
nor read as absent, each with its repair (``repair``): a damaged checkpoint releases nothing (the
window waits; the rank's resume from its checkpoint re-declares it), a damaged consumer.json
refuses the consumer's start; a damaged lease says nothing the window or status trusts, and its
rank's start or holder's next heartbeat rewrites it; a whole line of an acks log that does not
verify (not a crash's torn end) releases nothing from there on and refuses the rank's start,
unless from a step acknowledged before it (which cuts it off with the lines after it).

A rank's lease is held like the run lock: a second process for the same rank is refused while the
first lives (same host: its pid; another host: its heartbeat, fresh for ``lease_timeout``). When
the holder died the rank is taken over at once on its host, or once its heartbeat is older than
``lease_timeout`` elsewhere; either way what it had leased returns to the stream, logged.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import xxhash
from pydantic import BaseModel, Field

from hsx.errors import ConsumerRefused, Locked, RecordDamaged
from hsx.lock import STALE_AFTER, Holder, Liveness, RunLock, this_process
from hsx.store import records
from hsx.store.durable import create_exclusive, fsync_dir, writable_folder, write_all, write_durable
from hsx.store.layout import CONSUMERS

FORMAT = "hsx-consumer/1"
SPEC = "consumer.json"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
LEASE_TIMEOUT = STALE_AFTER
NOT_WRITTEN = "not written yet"  # why a rank waits for a sample whose file is not there (a producer's window goes on)
DELETED = "deleted as consumed"  # why a rank waits for a sample the run deleted once released (it never comes back)
READING = "being read"  # a sample whose file is there, its read not done yet: no reason to write more


def folder(run: Path, name: str) -> Path:
    return run / CONSUMERS / name


def rank_name(rank: int) -> str:
    return f"rank-{rank:06d}.json"


def acks_name(rank: int) -> str:
    return f"acks-{rank:06d}.jsonl"


def checkpoint_name(rank: int) -> str:
    return f"checkpoint-{rank:06d}.json"


class ConsumerSpec(BaseModel):
    """What fixes a consumer's sequence of batches; written once (``consumer.json``)."""

    format: str = FORMAT
    name: str
    ranks: int = Field(ge=1)
    seed: int
    max_tokens: int = Field(ge=1)
    packed: bool
    created: float = 0.0
    host: str = ""

    def differences(self, other: ConsumerSpec) -> list[str]:
        keys = ("ranks", "seed", "max_tokens", "packed")
        return [
            f"{k}: {getattr(self, k)} recorded, {getattr(other, k)} asked"
            for k in keys
            if getattr(self, k) != getattr(other, k)
        ]


class Ack(BaseModel):
    """One optimizer step's acknowledgement by one rank: the ids it trained since the previous one."""

    step: int
    batches: int  # the rank's batches acknowledged through this step
    ids: list[int]
    t: float


class RankRecord(Holder):
    """A rank's lease and heartbeat (``rank-NNNNNN.json``)."""

    command: str = "consume"
    consumer: str = ""
    rank: int = 0
    handed: int = 0  # batches handed out so far (its position in the rank's sequence)
    leased: list[int] = Field(default_factory=list)  # ids handed out and not acknowledged yet
    step: int = 0  # the last step acknowledged
    waiting_for: int | None = None  # the sample id it waits to land (or to be redone), if any
    waiting_why: str = ""
    waiting_since: float | None = None

    def describe(self) -> str:
        return f"rank {self.rank} of consumer {self.consumer}: held by {super().describe()}"

    @property
    def noun(self) -> str:
        return "trainer"


class Checkpoint(BaseModel):
    step: int
    t: float


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ConsumerRefused(
            f"consumer name {name!r}: letters, digits, '.', '_' or '-' (64 at most), not starting with a sign"
        )
    return name


@dataclass
class Journal:
    """A rank's acknowledgements as its log holds them (``read_acks``)."""

    acks: list[Ack]  # the lines that verify, up to the first that does not
    size: int  # the bytes they take: a last line torn by a crash, or damage, follows them
    damaged: RecordDamaged | None = None  # a whole line that does not verify, naming it: never a crash's
    later: list[Ack] = field(default_factory=list)  # the lines after the damage that verify (``rebuilt``)


def ack_line(run: Path, ack: Ack) -> bytes:
    """``ack`` as a line of the log: a record of ``run`` (``store.records``: its identity and a digest)."""
    return records.stamped(run, ack.model_dump(mode="json"), indent=None) + b"\n"


def read_acks(run: Path, path: Path) -> Journal:
    """A rank's acknowledgements. Each line is written by one ``write`` ending in its newline and
    fsynced before ``ack`` returns, so a crash can only leave a last line without its newline: it
    was never acknowledged, and ends the log. A whole line that does not verify (garbled, its
    digest not matching, another run's) is damage: it and every line after it are named
    (``Journal.damaged``, with the last step acknowledged intact before it), never read as a torn
    end; the lines before it stand. Lines written before hsx stamped them are read as they are.

    The window's gate reads every log before each batch: the lines this process verified before
    are not judged again where the log still begins with the same bytes (``_VERIFIED``)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Journal([], 0)
    except OSError as e:
        return Journal([], 0, RecordDamaged(path, f"unreadable ({e.strerror})"))
    run_id = records.identity(run)
    out: list[Ack] = []
    good = 0
    seen = _VERIFIED.get(path)
    if seen and seen.run == run_id and seen.size <= len(raw) and seen.digest == _digest(raw, seen.size):
        good, out = seen.size, list(seen.acks)
    *lines, _torn = raw[good:].split(b"\n")  # split on newlines only: a garbled line's other breaks are its own
    first, damage = len(out) + 1, None
    for i, line in enumerate(lines):
        try:
            out.append(Ack.model_validate(records.judge(path, line, run_id)))
        except (RecordDamaged, ValueError) as e:
            why = e.why if isinstance(e, RecordDamaged) else "garbled (not an acknowledgement)"
            rest = len(lines) - i - 1
            after = f", and the {rest} after it," if rest else ""
            last = f"step {out[-1].step}" if out else "none"
            damage = f"line {first + i} {why}: it{after} cannot be trusted (the last acknowledged before it: {last})"
            break
        good += len(line) + 1
    _VERIFIED[path] = _Verified(run_id, good, _digest(raw, good), tuple(out))
    if damage is None:
        return Journal(out, good)
    return Journal(out, good, RecordDamaged(path, damage), _intact(path, lines[i + 1 :], run_id))


def _intact(path: Path, lines: list[bytes], run_id: str | None) -> list[Ack]:
    """The acknowledgements of ``lines`` that verify (those after a damaged line)."""
    out = []
    for line in lines:
        try:
            out.append(Ack.model_validate(records.judge(path, line, run_id)))
        except (RecordDamaged, ValueError):
            continue
    return out


def rebuilt(journal: Journal, step: int, sequence: list[list[int]]) -> list[Ack]:
    """A damaged log through ``step``, a line past the damage that verifies, rebuilt from the rank's
    ``sequence`` of batches (``hsx.data.stream_batches``): each line after the damage acknowledges
    the batches between the line before it and its own count (``batches``), so the damaged lines'
    batches go to the next line that verifies, and their steps are gone (the lines past ``step``
    are rolled back by the resume). ``RecordDamaged`` where the lines that verify through ``step``
    do not follow each other."""
    out = list(journal.acks)
    for ack in journal.later:
        start = out[-1].batches if out else 0
        if (out and ack.step <= out[-1].step) or not start <= ack.batches <= len(sequence):
            if ack.step > step:
                break  # past the resume: rolled back anyway
            raise RecordDamaged(
                journal.damaged.path,
                f"{journal.damaged.why}; step {ack.step} (through batch {ack.batches}) does not follow the line "
                f"before it (step {out[-1].step if out else 0}, through batch {start}): it cannot be rebuilt",
            )
        out.append(ack.model_copy(update={"ids": [i for batch in sequence[start : ack.batches] for i in batch]}))
    return out


class _Verified(NamedTuple):
    """What this process verified of an acks log (``read_acks``): for which run, how many bytes,
    their digest, and their acknowledgements."""

    run: str | None
    size: int
    digest: bytes
    acks: tuple[Ack, ...]


_VERIFIED: dict[Path, _Verified] = {}


def _digest(raw: bytes, size: int) -> bytes:
    return xxhash.xxh3_128_digest(memoryview(raw)[:size])


def repair(path: Path) -> str:
    """What repairs a damaged record of a consumer (named by status and by the refusal)."""
    if path.name == SPEC:
        return (
            f"{SPEC} fixes the consumer's sequence of batches and cannot be rebuilt: restore it, or move "
            f"{path.parent} aside and start the consumer anew (its trainer from step 0), or under another name"
        )
    if path.name.startswith("acks-"):
        return (
            "resume the trainer from its last checkpoint with rebuild_acks=True, which rebuilds the damaged lines "
            "from the consumer's sequence of batches (the next line that verifies says how many the rank had "
            "trained); or resume every rank from a checkpoint at or before the last step acknowledged before the "
            "damage (resume_step; 0 trains it all again), which cuts the damaged line and every line after it off "
            "and hands their samples again: either way each sample is trained once"
        )
    if path.name.startswith("checkpoint-"):
        return (
            "it releases nothing until rebuilt: restart that rank from its last checkpoint (resume_step), "
            "which declares it again"
        )
    return "the rank rewrites its lease at its next heartbeat or start: restart the rank if it is not running"


def _read(run: Path, path: Path, kind: type[BaseModel], what: str):
    """``path`` read as a record of ``run`` (``store.records``) of ``kind``; None where absent."""
    body = records.read_record(run, path)
    try:
        return None if body is None else kind.model_validate(body)
    except ValueError:
        raise RecordDamaged(path, f"garbled (not {what})") from None


def read_checkpoint(run: Path, name: str, rank: int) -> Checkpoint | None:
    """The rank's declared checkpoint; ``RecordDamaged`` where it is damaged or another run's."""
    return _read(run, folder(run, name) / checkpoint_name(rank), Checkpoint, "a checkpoint declaration")


def read_spec(run: Path, name: str) -> ConsumerSpec | None:
    """The consumer's parameters; ``RecordDamaged`` where they are damaged or another run's."""
    return _read(run, folder(run, name) / SPEC, ConsumerSpec, "a consumer spec")


def read_lease(run: Path, name: str, rank: int) -> RankRecord | None:
    """The lease of rank ``rank`` of consumer ``name`` as its holder wrote it last; ``RecordDamaged``
    where it is damaged, another run's, or another rank's or consumer's (copied over it)."""
    path = folder(run, name) / rank_name(rank)
    lease = _read(run, path, RankRecord, "a lease")
    if lease is not None and (lease.consumer, lease.rank) != (name, rank):
        raise RecordDamaged(path, f"the lease of rank {lease.rank} of consumer {lease.consumer} (copied over it)")
    return lease


class Lease(RunLock):
    """A rank's lease, taken and kept fresh as the run lock is, written as a record of the run
    (stamped: ``store.records``) and judged on read (``read_lease``): one no holder of this rank
    wrote as it is is taken over at the rank's start, and rewritten by its holder's heartbeat."""

    def __init__(self, run: Path, me: RankRecord, stale_after: float, warn: Callable[[str], None]):
        super().__init__(folder(run, me.consumer), me=me, name=rank_name(me.rank), stale_after=stale_after, warn=warn)
        self.of = run

    def _body(self) -> bytes:
        return records.stamped(self.of, self.me.model_dump(mode="json"), indent=None)

    def holder(self) -> RankRecord | None:
        return read_lease(self.of, self.me.consumer, self.me.rank)


def names(run: Path) -> list[str]:
    """Every consumer that ever started on this run (a folder holding its spec or its ranks' records)."""
    try:
        return sorted(p.name for p in (run / CONSUMERS).iterdir() if p.is_dir() and any(p.iterdir()))
    except OSError:
        return []


@dataclass
class RankView:
    rank: int
    record: RankRecord | None
    state: Liveness | None
    acks: list[Ack]
    checkpoint: Checkpoint | None = None  # None also where its record is damaged (``damaged``): it releases nothing

    @property
    def released(self) -> set[int]:
        """Ids this rank acknowledged at a step its own declared checkpoint covers."""
        if self.checkpoint is None:
            return set()
        return {i for a in self.acks if a.step <= self.checkpoint.step for i in a.ids}


@dataclass
class ConsumerView:
    """One consumer as its records say, for status and the producer's window."""

    name: str
    spec: ConsumerSpec | None  # None where consumer.json is damaged (``damaged``): its ranks are unknown
    ranks: list[RankView] = field(default_factory=list)
    damaged: list[RecordDamaged] = field(default_factory=list)  # its records that cannot be trusted

    @property
    def acknowledged(self) -> set[int]:
        return {i for r in self.ranks for a in r.acks for i in a.ids}

    @property
    def released(self) -> set[int]:
        """Ids acknowledged at a step the acknowledging rank's declared checkpoint covers: the trainer
        never needs them again."""
        return {i for r in self.ranks for i in r.released}

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The step every rank's declared checkpoint covers (None until each rank declared one)."""
        points = [r.checkpoint for r in self.ranks]
        return None if None in points or not points else min(points, key=lambda c: c.step)

    @property
    def leased(self) -> set[int]:
        """Ids handed out and not acknowledged, by ranks still alive (a dead rank's return to the stream)."""
        return {i for r in self.ranks if r.record is not None and r.state == Liveness.ALIVE for i in r.record.leased}

    @property
    def step(self) -> int:
        """The last step every rank acknowledged."""
        return min(((r.acks[-1].step if r.acks else 0) for r in self.ranks), default=0)

    @property
    def last_ack(self) -> float | None:
        times = [r.acks[-1].t for r in self.ranks if r.acks]
        return max(times) if times else None


def inspect(run: Path, lease_timeout: float = LEASE_TIMEOUT) -> list[ConsumerView]:
    """Every consumer of the run with its ranks' records (judged alive, dead or stale); a damaged
    record is listed in its view's ``damaged``, never trusted (a damaged checkpoint releases nothing)."""
    out = []
    for name in names(run):
        try:
            spec = read_spec(run, name)
        except RecordDamaged as e:
            out.append(ConsumerView(name, None, damaged=[e]))
            continue
        if spec is None:  # its ranks' records without it: deleted
            out.append(ConsumerView(name, None, damaged=[RecordDamaged(folder(run, name) / SPEC, "missing")]))
            continue
        view = ConsumerView(name, spec)
        d = folder(run, name)
        for r in range(spec.ranks):
            rec = checkpoint = state = None
            try:
                rec = read_lease(run, name, r)
                state = None if rec is None else rec.state(stale_after=lease_timeout)
            except RecordDamaged as e:
                view.damaged.append(e)
            try:
                checkpoint = read_checkpoint(run, name, r)
            except RecordDamaged as e:
                view.damaged.append(e)
            journal = read_acks(run, d / acks_name(r))  # damaged: what follows the damage releases nothing
            view.damaged += [journal.damaged] if journal.damaged else []
            view.ranks.append(RankView(r, rec, state, journal.acks, checkpoint))
        out.append(view)
    return out


class RankLease:
    """One rank of a consumer, held by this process: its lease, its acknowledgements, its heartbeat.

    ``resume_step``: None for a rank that has acknowledged nothing yet; else the step of the
    checkpoint the trainer resumes from (0: from the start), which must be one this rank
    acknowledged. ``lease_timeout``: how long a holder on another host may stay silent before its
    rank (and what it leased) is taken over. ``rebuild``: the rank's sequence of batches, where the
    trainer asks that a damaged log be rebuilt from it to resume from a step past the damage
    (``rebuilt``); without it such a resume is refused."""

    def __init__(
        self,
        run: Path,
        spec: ConsumerSpec,
        rank: int,
        resume_step: int | None = None,
        lease_timeout: float = LEASE_TIMEOUT,
        log: Callable[[str], None] = print,
        rebuild: list[list[int]] | None = None,
    ):
        if not 0 <= rank < spec.ranks:
            raise ConsumerRefused(f"rank {rank} is not one of consumer {spec.name}'s ranks 0..{spec.ranks - 1}")
        self.run, self.spec, self.rank, self.log = run, spec, rank, log
        self.dir = folder(run, check_name(spec.name))
        self.lease_timeout, self.rebuild = lease_timeout, rebuild
        self.acks_path = self.dir / acks_name(rank)
        self.checkpoint_path = self.dir / checkpoint_name(rank)
        self._lock = threading.Lock()
        writable_folder(self.dir)  # a file where consumers/ or its folder should be: refused by name
        self._agree()
        self.me = this_process("consume", RankRecord, consumer=spec.name, rank=rank)
        self.held = Lease(run, self.me, lease_timeout, log)
        self._take()
        try:
            self.acks = self._resume(resume_step)
        except BaseException:
            self.close()  # a refused resume leaves the rank to the next try
            raise
        self.position = self.acks[-1].batches if self.acks else 0
        self.me.handed, self.me.step = self.position, self.acks[-1].step if self.acks else 0
        self._pending: list[int] = []  # ids handed since the last acknowledgement
        self.held.beat()

    def _agree(self) -> None:
        """Record the consumer's parameters (first rank), or refuse a start that asks for others."""
        spec = self.spec.model_copy(update={"created": time.time(), "host": socket.gethostname()})
        create_exclusive(self.dir / SPEC, records.stamped(self.run, spec.model_dump(mode="json"), indent=2))
        try:
            recorded = read_spec(self.run, self.spec.name)
        except RecordDamaged as e:
            raise RecordDamaged(e.path, f"{e.why}; {repair(e.path)}") from None
        if recorded is None:
            raise ConsumerRefused(f"{self.dir / SPEC} vanished as the consumer started: start it again")
        diff = recorded.differences(self.spec)
        if diff:
            raise ConsumerRefused(
                f"consumer {self.spec.name} of {self.run} was started with other parameters ({'; '.join(diff)}): "
                "resume it with the recorded ones, or start another consumer name"
            )

    def _take(self) -> None:
        """Take the rank's lease: refused while its holder lives on this host, waited for (until its
        heartbeat is ``lease_timeout`` old) while it holds it from another; what a dead holder had
        leased returns to the stream, logged."""
        try:
            before = self.held.holder()
        except RecordDamaged:  # what it says it leased cannot be trusted; its take-over names it
            before = None
        waited = False
        while True:
            try:
                self.held.acquire()
                break
            except Locked as e:
                other = e.holder
                if other.host == socket.gethostname():
                    raise ConsumerRefused(f"{other.describe()}: stop that process first") from e
                if not waited:
                    self.log(f"{other.describe()}; waiting until it is {self.lease_timeout:g}s old (the lease timeout)")
                    waited = True
                time.sleep(max(0.05, min(1.0, other.heartbeat + self.lease_timeout - time.time())))
                before = other
        if isinstance(before, RankRecord) and before.pid != self.me.pid:
            why = "after the lease timeout" if before.host != self.me.host else "as its process is gone"
            self.log(
                f"rank {self.rank} of consumer {self.spec.name}: the {len(before.leased)} samples leased by "
                f"pid {before.pid} on {before.host} (heartbeat {time.time() - before.heartbeat:.0f}s ago) "
                f"return to the stream {why}"
            )

    def _resume(self, step: int | None) -> list[Ack]:
        """The acknowledgements kept: all of them for a first start, those through ``step`` for a resume."""
        journal = read_acks(self.run, self.acks_path)
        acks, damaged = journal.acks, journal.damaged
        rebuild = self.rebuild is not None and damaged is not None and step in {a.step for a in journal.later}
        if rebuild:
            acks = rebuilt(journal, step, self.rebuild)
        steps = [a.step for a in acks]
        if damaged is not None and not rebuild and (step is None or (step and step not in steps)):
            raise RecordDamaged(damaged.path, f"{damaged.why}; {repair(damaged.path)}")
        if step is None:
            if acks:
                raise ConsumerRefused(
                    f"rank {self.rank} of consumer {self.spec.name} acknowledged steps up to {steps[-1]}: pass "
                    "resume_step, the step of the checkpoint the trainer resumes from (0 to train it all again)"
                )
            step = 0
        if step and step not in steps:
            near = ", ".join(map(str, [s for s in steps if s < step][-3:] + [s for s in steps if s > step][:3]))
            raise ConsumerRefused(
                f"rank {self.rank} of consumer {self.spec.name} never acknowledged step {step} "
                f"(acknowledged near it: {near or 'none'}): resume from a checkpoint whose step it acknowledged "
                "(acknowledge a step before saving its checkpoint)"
            )
        kept = [a for a in acks if a.step <= step]
        dropped = acks[len(kept) :]
        if dropped or journal.size != self._size():
            write_durable(self.acks_path, b"".join(ack_line(self.run, a) for a in kept))
        if rebuild:
            self.log(
                f"{damaged}: rebuilt from the consumer's sequence of batches at the resume from step {step} (the "
                "damaged lines' batches acknowledged by the next line that verifies)"
            )
        elif damaged is not None:
            self.log(f"{damaged}: cut off at the resume from step {step} (their samples are trained again)")
        if dropped:
            n = sum(len(a.ids) for a in dropped)
            self.log(
                f"rank {self.rank} of consumer {self.spec.name} resumes at step {step}: its acknowledgements of "
                f"steps {dropped[0].step}..{dropped[-1].step} are rolled back ({n} samples are trained again)"
            )
        try:
            checkpoint = read_checkpoint(self.run, self.spec.name, self.rank)
            stale = checkpoint is not None and checkpoint.step > step
        except RecordDamaged as e:  # the trainer resumes from its checkpoint at ``step``: that declares it again
            self.log(f"{e}: declared again at step {step}, the checkpoint this rank resumes from")
            stale = True
        if stale:
            self._declare(step)
        return kept

    def _size(self) -> int:
        try:
            return self.acks_path.stat().st_size
        except FileNotFoundError:
            return 0

    def handed(self, ids: list[int]) -> None:
        """A batch handed to the trainer: leased until acknowledged (the record says so at once)."""
        with self._lock:
            self._pending += ids
            self.position += 1
            self.me.handed, self.me.leased = self.position, list(self._pending)
        self.held.beat()

    def waiting(self, sample_id: int | None, why: str = "") -> None:
        """What the rank waits for (None: nothing), recorded as it changes."""
        with self._lock:
            if (sample_id, why) == (self.me.waiting_for, self.me.waiting_why):
                return
            if sample_id != self.me.waiting_for:
                self.me.waiting_since = time.time() if sample_id is not None else None
            self.me.waiting_for, self.me.waiting_why = sample_id, why
        self.held.beat()

    def ack(self, step: int) -> list[int]:
        """Acknowledge every batch handed out since the last acknowledgement at optimizer step ``step``,
        durably (appended and fsynced) before returning; returns their ids."""
        with self._lock:
            last = self.acks[-1].step if self.acks else 0
            if step <= last:
                raise ValueError(f"step {step} acknowledged after step {last}: steps only grow")
            ack = Ack(step=step, batches=self.position, ids=self._pending, t=time.time())
            fd = os.open(self.acks_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                write_all(fd, ack_line(self.run, ack))
                os.fsync(fd)
            finally:
                os.close(fd)
            if not last:
                fsync_dir(self.dir)  # the log's first line: its name is durable too
            self.acks.append(ack)
            self._pending = []
            self.me.leased, self.me.step = [], step
        self.held.beat()
        return ack.ids

    def checkpointed(self, step: int) -> None:
        """The trainer's checkpoint of ``step`` is durable: what this rank acknowledged through it is
        released. ``step`` must be one this rank acknowledged: a checkpoint of a step it had not
        acknowledged yet (another rank saved it first) could not be resumed by this rank."""
        with self._lock:
            steps = [a.step for a in self.acks]
        if step not in steps:
            raise ConsumerRefused(
                f"rank {self.rank} of consumer {self.spec.name} declares a checkpoint of step {step}, which it has "
                f"not acknowledged (last acknowledged: {steps[-1] if steps else 'none'}): acknowledge each step "
                "before its checkpoint is saved (with several ranks: every rank's ack, then a barrier, then the save)"
            )
        self._declare(step)

    def _declare(self, step: int) -> None:
        body = Checkpoint(step=step, t=time.time()).model_dump(mode="json")
        records.write_record(self.run, self.checkpoint_path, body)

    def start(self) -> RankLease:
        """Keep the rank's heartbeat fresh until ``close``."""
        self.held.keep()
        return self

    def close(self) -> None:
        """Stop the heartbeat and give the lease back (what is leased and unacknowledged returns)."""
        self.held.__exit__(None, None, None)
