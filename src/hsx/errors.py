"""Every error hsx raises on purpose, under one root, and the exit code each one means.

    HsxError
    ├── Refused                  the run cannot start, resume or be read as asked: a person acts (exit 2)
    │   ├── OptionError            an option's value makes no sense (--packing yes, layer 99 of 32); a ValueError too
    │   ├── InputError             a data file cannot be read at all (rows that are bad are rejects)
    │   ├── SpecError              the run spec is missing, unreadable or damaged
    │   ├── PlanError              the frozen plan is unreadable, does not match the spec, or is empty
    │   ├── ModelNotFound          the model is not where the spec or --model says
    │   ├── ModelChanged           the model there is not the run's (fingerprint differs)
    │   ├── UnsupportedModel       the capture backend cannot hook this architecture
    │   ├── TokenizerError         the model's tokenizer cannot load (its code does not import, remote code not
    │   │                          allowed) or cannot plan (no chat template, no template of the name asked)
    │   ├── Locked                 another extractor (or scale-out driver) holds the run
    │   ├── NotEnoughSpace         the projected size exceeds free space (--allow-partial starts anyway)
    │   ├── LayoutTooLarge         the model does not fit the devices' memory in the asked parallel layout
    │   ├── CaptureFailed          the backend did not deliver a sample as the plan has it
    │   ├── FidelityFailed         the captured states do not predict the target's next tokens: the run stopped
    │   ├── CertifyFailed          a tap is not what the target computes (per-tap checks, the shadow): the run stopped
    │   ├── WorkerFailed           a scale-out worker failed on a shard; the run stopped
    │   ├── RepairRefused          verify --repair on a run an extractor is writing
    │   ├── NormUnavailable        the final norm (or LM head) cannot be read or inverted from the checkpoint
    │   ├── ExportRefused          the export cannot go on as asked
    │   ├── VocabError             the draft vocabulary cannot be built as asked
    │   └── ConsumerRefused        a trainer's stream cannot start or resume as asked (a step it never
    │                              acknowledged, its rank held by a live process, other parameters)
    ├── CleanStop                the volume filled; stopped cleanly, resumable once space is freed (exit 3)
    ├── EngineUnavailable        the generation servers stopped answering; stopped cleanly, resumable (exit 2)
    ├── DiskFull (also OSError)  ENOSPC or the reserve reached while writing one file (the store's signal),
    │                            or another write stop (EFBIG, EROFS, EIO: ``WRITE_STOPS``, their own words)
    │   └── LowSpace               free space fell under the reserve before a batch
    ├── BadFile                  a sample file is not valid: truncated, corrupt or misplaced (scans catch it)
    └── SampleUnavailable        the loader cannot serve a sample (not verified, outside the plan)

Anything else is a bug: the command line lets it surface as a traceback (exit 1), never as "refused".
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from enum import IntEnum, StrEnum
from pathlib import Path

from hsx.units import size


class Exit(IntEnum):
    """Exit codes of every command. ``status``/``verify`` use OK, REDO and ACT for their verdict."""

    OK = 0
    REDO = 1  # status/verify: damage that hsx extract repairs by itself (also a bug's traceback)
    ACT = 2  # a person must act first; every refusal
    DISK_FULL = 3
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
    TERMINATED = 143  # SIGTERM (128 + SIGTERM), what schedulers send before a kill


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is: every clean stop written
    for Ctrl-C (work in flight finished or dropped whole, the resume command printed) serves both."""


_HELD = {"depth": 0}  # ``uninterrupted`` blocks entered; "stop": the stop that came meanwhile


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Ctrl-C and SIGTERM held off while a few updates that must all happen or none run (a durable
    file's count: its shard's tally, the run's, the progress line): the stop is raised right after
    them, never between two, so the stop message counts every file made durable. Python raises a
    signal's exception between any two statements of the main thread; hsx's own handlers
    (``hsx.cli.output.failures``) ask ``stop`` instead."""
    _HELD["depth"] += 1
    try:
        yield
    finally:
        _HELD["depth"] -= 1
    if not _HELD["depth"] and (stop := _HELD.pop("stop", None)) is not None:
        raise stop


def stop(exc: KeyboardInterrupt) -> None:
    """Raise a Ctrl-C's or SIGTERM's ``exc`` now, or, inside ``uninterrupted``, once it ends."""
    if _HELD["depth"]:
        _HELD.setdefault("stop", exc)
        return
    raise exc


class HsxError(Exception):
    """The root: every error hsx raises on purpose."""

    exit_code: Exit = Exit.ACT


class Refused(HsxError):
    """The run cannot start or resume as asked; the message says why and what to do."""


class OptionError(Refused, ValueError):
    """Also a ValueError: what Python code calling hsx expects of a bad argument."""


class InputError(Refused):
    pass


class SpecError(Refused):
    pass


class RecordDamaged(Refused):
    """A record hsx keeps beside the data is there but cannot be trusted (``store.records``); ``why``
    says how, for status and the repair."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


class PlanError(Refused):
    pass


class ModelNotFound(Refused):
    pass


class ModelChanged(Refused):
    pass


class UnsupportedModel(Refused):
    pass


class TokenizerError(Refused):
    pass


class Locked(Refused):
    """Another live process holds the run; ``holder`` says who (anything with ``describe()``)."""

    def __init__(self, holder):
        super().__init__(f"another {getattr(holder, 'noun', 'extractor')} holds this run: {holder.describe()}")
        self.holder = holder


class NotEnoughSpace(Refused):
    pass


class LayoutTooLarge(Refused):
    pass


class CaptureFailed(Refused):
    pass


class InterconnectHung(Refused):
    """The node's first all-reduce did not return within its bound (``hsx.interconnect``): NCCL
    hangs so on some PCIe nodes with peer-to-peer copies on. The message names the fixes."""


class FidelityFailed(Refused):
    """The final states of a batch, through the target's own final norm and LM head, do not predict
    the next tokens as the run's floor or baseline says they must (``hsx.fidelity``); nothing of that
    batch was written. A person finds the cause (layer, norm, kernel, positions) before resuming."""


class CertifyFailed(Refused):
    """A sample's taps failed their checks (not finite, all zeros, outside the run's RMS band) or
    differ from transformers' plain recomputation of the sample (``hsx.certify``); nothing of that
    batch was written, or (found after the fact) the run's certificate records the failure."""


class WorkerFailed(Refused):
    pass


class RepairRefused(Refused):
    pass


class Crashed(HsxError):
    """An error hsx did not expect, met by a job: recorded in the run folder (``job.folder.Failure``)
    and said in one line instead of a traceback; exit 1, as a traceback's. Raised from the original
    exception (its ``__cause__``), so a caller of the API still has its type and traceback."""

    exit_code = Exit.REDO


class NormUnavailable(Refused):
    pass


class ExportRefused(Refused):
    pass


class VocabError(Refused):
    pass


class ConsumerRefused(Refused):
    pass


class CleanStop(HsxError):
    """The volume filled up (or another write stop: ``WRITE_STOPS``); the run stopped cleanly and
    resumes once a person did what ``advice`` says (free space).

    ``summary`` is the job's summary at the stop (its ``done``, ``total_samples`` and ``run``),
    ``needed_bytes`` the space the rest still needs, ``path`` the file or folder being written and
    ``reason`` what stopped it; ``resume`` the command that resumes it, whose files are ``unit``.
    ``lines()`` says all of it, the same words wherever the stop happened (a process of its own, a
    tensor-parallel group's rank 0, a scale-out worker)."""

    exit_code = Exit.DISK_FULL

    def __init__(
        self,
        summary,
        needed_bytes: int,
        path: Path,
        reason: str | None = None,
        resume: str = "",
        unit: str = "samples",
        advice: str = "Free space",
    ):
        self.reason = reason or no_space(path)
        super().__init__(self.reason)
        self.summary, self.needed_bytes, self.path = summary, needed_bytes, Path(path)
        self.resume, self.unit, self.advice = resume, unit, advice

    def lines(self) -> str:
        s = self.summary
        return (
            f"{self.reason}.\nStopped cleanly: {s.done}/{s.total_samples} {self.unit} are done and verified; "
            f"about {size(self.needed_bytes)} more are needed to finish.\n{self.advice}, then resume: {self.resume}"
        )


def no_space(path: Path | str) -> str:
    """What a clean stop says of a real ENOSPC (the guard's reserve says its own words)."""
    return f"no space left on the output volume while writing {path}"


class EngineUnavailable(HsxError):
    """The generation engine (its servers) failed request after request, or answers as no request can
    succeed (a wrong URL or model name); the generate job stops cleanly and the same command resumes."""


# the write errors a run stops cleanly on (every file whole or absent), each in its own words: what
# happened, and what a person does before the same command resumes (ENOSPC's: ``no_space``)
WRITE_STOPS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on the output volume", "Free space"),
    errno.EDQUOT: ("no space left on the output volume", "Free space"),  # the quota: the same remedy
    errno.EFBIG: (
        "a file reached the size limit (ulimit -f, or the file system's largest file)",
        "Raise the file-size limit (ulimit -f)",
    ),
    errno.EROFS: (
        "the output volume is read-only (mounted so, or remounted after an error)",
        "Make the volume writable again (remount it read-write)",
    ),
    errno.EIO: ("an I/O error on the output volume", "Check the volume (dmesg, its health) or move the run"),
}


class DiskFull(HsxError, OSError):
    """A write the run stops cleanly on while writing ``path``: the volume ran out of space (or
    quota), or another of ``WRITE_STOPS`` (a file-size limit, a read-only volume, an I/O error)."""

    exit_code = Exit.DISK_FULL

    def __init__(self, path: Path, cause: OSError | None = None):
        code = cause.errno if cause is not None and cause.errno in WRITE_STOPS else errno.ENOSPC
        OSError.__init__(self, code, f"{WRITE_STOPS[code][0]} while writing {path}")
        self.path = path
        self.cause = cause

    @property
    def reason(self) -> str | None:
        """What a clean stop says stopped it (None: ``CleanStop``'s words for a plain ENOSPC)."""
        return None if self.errno in (errno.ENOSPC, errno.EDQUOT) else self.strerror

    @property
    def advice(self) -> str:
        """What a person does before the same command resumes."""
        return WRITE_STOPS.get(self.errno or errno.ENOSPC, WRITE_STOPS[errno.ENOSPC])[1]


class Unwritable(Refused):
    """A destination hsx was given (an export's, a vocabulary's, a consumer's folder) cannot be
    written: under a file, a file itself, read-only, or not permitted."""


class LowSpace(DiskFull):
    """Free space fell under the reserve: stop before the volume is full, exactly as on ENOSPC."""

    def __init__(self, path: Path, free: int, pending: int, reserve: int, message: str):
        super().__init__(path)
        self.free, self.pending, self.reserve = free, pending, reserve
        self.strerror = message

    def __str__(self) -> str:
        return self.strerror

    @property
    def reason(self) -> str | None:
        return self.strerror


class Damage(StrEnum):
    """What is wrong with a file the scan found (a sample's or a stray one)."""

    MISSING = "missing"
    TRUNCATED = "truncated"
    CORRUPT = "corrupt"
    MISPLACED = "misplaced"
    FOREIGN = "foreign"
    STRAY = "stray"
    RECORD = "damaged record"  # a record hsx keeps of a shard (sealed/, consumed/): missing or damaged


class BadFile(HsxError):
    """Why a sample file is not valid; ``kind`` is truncated, corrupt or misplaced."""

    def __init__(self, kind: Damage | str, detail: str):
        kind = Damage(kind)
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class SampleUnavailable(HsxError):
    pass


class PlaneError(HsxError):
    """The data plane (``hsx.plane``) refused a put or a removal: the pool is full or unreachable."""


def refusal(name: str, message: str) -> Refused:
    """A refusal raised in another process (a rank, a worker's group), rebuilt here from its class
    name and message; a name that is not a refusal of hsx's becomes a plain ``Refused``."""
    cls = globals().get(name)
    cls = cls if isinstance(cls, type) and issubclass(cls, Refused) else Refused
    error = cls.__new__(cls)  # its message as said there: a class's own constructor (Locked's holder) is not run
    Refused.__init__(error, message)
    return error
