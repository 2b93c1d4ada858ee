"""The in-process executor (``extract.executor``): the job in this process (``job.stage.session``: the
run's lock, the prologue, the clean stop), whose work loads the model and extracts while the digests
are verified: every shard that is not complete is extracted, once its own scan is settled, and
sealed. A tensor-parallel group's rank 0 runs it too, with the other ranks as its ``peers``
(``extract.group``).

The model is loaded only when something is missing: a resume that finds every file in place verifies
them and loads nothing, and loads the model afterwards only if a digest was bad."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hsx import target
from hsx.extract.backends import Session, backend, entry
from hsx.extract.options import ExtractOptions
from hsx.extract.stage import Extract
from hsx.extract.summary import ExtractSummary
from hsx.extract.window import sweep
from hsx.job.model import Model
from hsx.job.options import set_threads
from hsx.job.resume import Verifier
from hsx.job.stage import Job, session
from hsx.spec import RunSpec
from hsx.store.scan import ShardScan

if TYPE_CHECKING:
    from hsx.extract.backends import Peers


class InProcess(Extract):
    """This process runs the whole job; ``peers``: the other ranks of its tensor-parallel group, told
    when to load the model and which batch comes next (None: a process alone); ``model``: the job's,
    where the run was opened in this process (None: found again from the run)."""

    def __init__(self, peers: Peers | None = None, model: Model | None = None):
        self.peers, self.model = peers, model

    def run(self, opts: ExtractOptions, spec: RunSpec, log: Callable[[str], None] = print) -> ExtractSummary:
        model = self.model or Model.of_run(opts.model, opts.trust_remote_code, opts.out, spec)
        return session(self, opts, spec, model, log)

    def work(self, job: Job[ExtractOptions, RunSpec, ExtractSummary]) -> None:
        opts, spec, progress, summary = job.opts, job.spec, job.progress, job.summary
        progress.start(0, 0)
        verifier = job.verify()
        summary.verified = verifier.stats
        progress.verified = verifier.stats.metrics
        try:
            how = entry(spec.backend)
            todo: Iterable[ShardScan] = verifier.todo()  # the shards that miss samples, as they are settled
            work = True  # the headers say something is missing: load the model now, beside verification
            if all(s.complete for s in job.begun.headers) or how.whole:
                todo = verifier.rest()  # nothing missing (or a backend that takes its work whole): no model yet
                work = bool(todo)
            if work:
                resources = opts.resources()
                set_threads(resources.threads, resources.device)
                session = Session(
                    job.run, spec, job.plan, job.model.dir, resources, progress, job.begun.space, job.log,
                    opts.tensor_parallel_size or 1, opts.data_parallel_size or 1, self.peers,
                )  # fmt: skip
                with target.Digests(job.run, job.spec, job.model.dir):  # the weights' full digests, beside the work
                    backend(spec.backend).run(session, todo)  # torch or vLLM: imported only when there is work
                if not how.whole:
                    _log_verified(verifier, job.log)
            sweep(job.run, spec.window, spec.shard_size, job.log)
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: the stop message says what is done
            e.add_note(f"{progress.counts()[0]}/{spec.plan.num_samples} samples are done and durable")
            raise
        finally:
            verifier.stop()
            summary.seconds = progress.elapsed()
            summary.written, summary.tokens_written, summary.bytes_written = progress.session()
            summary.waited_for_disk = progress.waited_for_disk() if progress.waited_for_disk else 0.0


def _log_verified(verifier: Verifier, log: Callable[[str], None]) -> None:
    v = verifier.stats
    if v.files:
        log(
            f"verified {v.files:,} files ({v.bytes / 1e9:,.2f} GB) in {v.seconds:.1f}s at {v.rate / 1e9:.2f} GB/s; "
            f"extraction waited {v.waited:.1f}s for it"
        )
