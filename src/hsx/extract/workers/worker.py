"""A scale-out worker's work: load the target once, then extract whole shards, one per call.

A shard is done exactly as a resume does it (``job.resume.verify_shard``), so a retried shard (its
worker died mid-way) keeps its verified samples and redoes the rest with the single-process
``Extractor`` (same batches, same bytes), then seals; what it did crosses back to the driver as an
``extract.outcome.Outcome``. Ray's side is ``workers.actor``; this module never imports Ray.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hsx import registry, target
from hsx.errors import DiskFull, HsxError, ModelChanged, Refused
from hsx.extract.backends import Peers, Resources
from hsx.extract.outcome import Outcome, ShardRun
from hsx.extract.pipeline import Extractor, open_backend
from hsx.extract.summary import ExtractSummary
from hsx.job.options import set_threads
from hsx.job.resume import verify_shard
from hsx.job.space import Forecast, Start
from hsx.lock import Holder
from hsx.plan import load_plan
from hsx.progress import Progress
from hsx.spec import load_spec


@dataclass(frozen=True)
class WorkerTask:
    """What every worker of a run needs, resolved by the driver (no ExtractOptions crosses to Ray)."""

    run: str
    model: str | None  # --model as given: each node checks its own copy against the fingerprint
    resources: Resources
    deep_verify: bool
    driver: dict  # the driver's lock Holder, as a dict
    reserve: int  # free bytes this worker keeps, counting the other workers' batches
    # what the start found (``job.space.plan_space``): the files on disk (the codec's measured ratio),
    # and whether a zstd run too large at raw size is still to be judged on its first files
    start: Start = field(default_factory=Start)


@dataclass(frozen=True)
class Where:
    """What Ray says of a worker, for its heartbeat record."""

    node: str
    gpus: list[str]
    restarted: bool


class ShardRunner:
    """Extracts whole shards, one per call, in this process: a worker alone, or rank 0 of a
    worker's tensor-parallel group (``peers``: the other ranks; ``ranks``: the group's processes)."""

    def __init__(self, task: WorkerTask, where: Where, peers: Peers | None = None, ranks: Sequence[registry.Rank] = ()):
        self.run = Path(task.run)
        self.task = task
        self.beat = registry.Heartbeat(
            self.run,
            Holder(**task.driver),
            node=where.node,
            device=task.resources.device,
            gpus=where.gpus,
            restarted=where.restarted,
            ranks=list(ranks),
        )
        if not self.beat.driver_holds_run():  # a restart after the driver died: write nothing
            os._exit(registry.FENCED_EXIT)
        self.beat.start()
        try:
            self._load(task, peers)
        except Refused as e:  # the driver raises it: a retry on this node would meet it again
            self.beat.refused(e)
            raise
        self.beat.counters = self.progress.session
        self.broken: str | None = None  # after a full disk the writer is spent: refuse further shards
        self.beat.update(phase="idle")

    def _load(self, task: WorkerTask, peers: Peers | None) -> None:
        """Check this node's model, then load it (with the group's other ranks) and the run's plan."""
        self.spec = load_spec(self.run)
        try:  # the driver checked its own copy of the model; this checks this node's
            model_dir = target.model_dir_for(self.run, self.spec, task.model)
        except ModelChanged as e:
            raise ModelChanged(f"the model on {self.beat.record.host}: {e}") from e
        plan = load_plan(self.run, self.spec)
        self.progress = Progress(self.spec.plan.num_samples, self.spec.plan.num_tokens, self.spec.bytes_per_token)
        if peers is not None:
            peers.load()
        set_threads(task.resources.threads, task.resources.device)  # rank 0 of a group: as its rank set up
        backend = open_backend(self.spec, model_dir, task.resources.device)
        # the start's forecast, with this worker's own files as it writes them (``Extractor`` binds them). An
        # undecided run is judged by each worker on its own first files against the whole rest of the run,
        # not the rest less the other workers' files: it errs high, never low.
        forecast = Forecast(self.spec, task.start)
        self.extractor = Extractor(
            self.run,
            self.spec,
            plan,
            backend,
            task.resources,
            self.progress,
            task.reserve,
            peers=peers,
            forecast=forecast,
        )

    def __call__(self, shard: int) -> Outcome:
        """Shard ``shard`` verified, its missing samples extracted, sealed: its ``Outcome`` (no
        summary where it was skipped: the run is stopping)."""
        rec = self.beat.record
        done = ShardRun(shard=shard, host=rec.host, pid=os.getpid(), gpus=",".join(rec.gpus), began=time.time())
        if self.broken or registry.stop_requested(self.run):
            return Outcome(shard=done.model_copy(update={"ended": time.time()}))
        self.beat.update(shard=shard, shard_since=time.time(), phase="working")
        before = self.progress.session()
        summary = ExtractSummary.of(self.run, self.spec)
        t0 = time.monotonic()
        outcome = Outcome(summary=summary)
        try:
            scan = verify_shard(self.run, self.spec, shard, self.task.deep_verify, summary)
            if not scan.complete:
                self.extractor.finish(scan, self.extractor.shard(scan))
        except DiskFull as e:
            self.broken = f"the output volume filled up on {rec.host}"
            self.extractor.close()  # queued writes finish or remove their temp files
            outcome = Outcome.stopped(summary, e)
        except Exception as e:  # reported to the driver, which stops the run cleanly
            if self.extractor.peers is not None and not isinstance(e, HsxError):
                raise  # a collective broke (a rank died): the group fails and Ray retries the shard
            outcome = Outcome.failed(e, summary)
            traceback.print_exc()
        after = self.progress.session()
        summary.written, summary.tokens_written, summary.bytes_written = (
            a - b for a, b in zip(after, before, strict=True)
        )
        summary.seconds = time.monotonic() - t0
        outcome.shard = done.model_copy(update={"ended": time.time()})
        shards = rec.shards_done + (0 if outcome.stop or outcome.failure else 1)
        self.beat.update(shard=None, shard_since=None, phase="idle", shards_done=shards)
        return outcome
