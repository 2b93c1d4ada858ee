"""What an extraction's work ended in, as one typed value, wherever it ran: ``Outcome``.

Every executor (``extract.executor``) hands its work's end back as an ``Outcome``: a tensor-parallel
group's rank 0 to the launcher (the whole job), a scale-out worker to its driver (one shard), rank 0
of a worker's group to its Ray actor (one shard). It holds the tally (``summary``) and at most one of
a clean stop (``stop``: the volume filled) or a failure (``failure``: an hsx error, by class and
message); ``result`` raises either here as if it had happened here, or returns the tally. It
crosses processes as JSON, written and read only here (``dump``/``load``; ``row``/``of_row`` as a
Ray dataset's row): no pickle, no hand-made dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from hsx import errors
from hsx.errors import CleanStop, DiskFull, HsxError
from hsx.extract.summary import ExtractSummary


class Stop(BaseModel):
    """A clean stop: the volume filled while writing ``path``; ``reason`` says how (None: a real
    ENOSPC). ``needed_bytes``: what the rest of the run still needs, once the job's prologue counted
    it (None from a worker of one shard, whose driver counts it for the whole run)."""

    path: str
    reason: str | None = None
    advice: str = "Free space"  # what a person does before the resume (``errors.WRITE_STOPS``)
    needed_bytes: int | None = None
    resume: str = ""


class Failure(BaseModel):
    """An hsx error the work raised: its class (``hsx.errors``) and message."""

    error: str
    message: str

    def refusal(self) -> errors.Refused:
        return errors.refusal(self.error, self.message)


class ShardRun(BaseModel):
    """Which shard a scale-out worker did, and where and when: for the driver's log."""

    shard: int
    host: str
    pid: int
    gpus: str = ""
    began: float = 0.0
    ended: float = 0.0


class Outcome(BaseModel):
    summary: ExtractSummary | None = None  # None: the work never began (a worker that skipped its shard)
    stop: Stop | None = None
    failure: Failure | None = None
    shard: ShardRun | None = None  # a scale-out worker's: which shard, where, when

    @classmethod
    def of(cls, work: Callable[[], ExtractSummary]) -> Outcome:
        """Run ``work``: its summary, or the clean stop or hsx error it raised (a bug propagates)."""
        try:
            return cls(summary=work())
        except CleanStop as e:
            stop = Stop(
                path=str(e.path), reason=e.reason, advice=e.advice, needed_bytes=e.needed_bytes, resume=e.resume
            )
            return cls(summary=e.summary, stop=stop)
        except HsxError as e:
            return cls.failed(e)

    @classmethod
    def failed(cls, e: BaseException, summary: ExtractSummary | None = None) -> Outcome:
        return cls(summary=summary, failure=Failure(error=type(e).__name__, message=str(e)))

    @classmethod
    def stopped(cls, summary: ExtractSummary, e: DiskFull) -> Outcome:
        """A full disk met by a worker of one shard: the driver's prologue counts what the rest needs."""
        return cls(summary=summary, stop=Stop(path=str(e.path), reason=e.reason, advice=e.advice))

    def result(self) -> ExtractSummary:
        """The summary; or the clean stop or refusal, raised here as it was raised there."""
        if self.failure is not None:
            raise self.failure.refusal()
        if self.stop is not None:
            s = self.stop
            raise CleanStop(self.summary, s.needed_bytes or 0, Path(s.path), s.reason, s.resume, advice=s.advice)
        assert self.summary is not None
        return self.summary

    def dump(self) -> str:
        return self.model_dump_json()

    @classmethod
    def load(cls, text: str | bytes) -> Outcome:
        return cls.model_validate_json(text)

    def row(self) -> dict:
        """A Ray dataset's row (``map_batches`` with numpy batches of one)."""
        return {"outcome": np.array([self.dump()])}

    @classmethod
    def of_row(cls, row: dict) -> Outcome:
        value = row["outcome"]
        return cls.load(value.item() if hasattr(value, "item") else value)
