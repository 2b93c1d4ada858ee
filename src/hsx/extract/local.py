"""The in-process executor (``extract.executor``): the job in this process. It opens the run's lock,
checks the headers and the space, then loads the model and extracts while the digests are verified
(``job.prologue``, the prologue every job runs): every shard that is not complete is extracted, once
its own scan is settled, and sealed. A tensor-parallel group's rank 0 runs it too, with the other
ranks as its ``peers`` (``extract.group``).

The model is loaded only when something is missing: a resume that finds every file in place verifies
them and loads nothing, and loads the model afterwards only if a digest was bad."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hsx import registry, target
from hsx.errors import DiskFull
from hsx.extract.backends import Session, backend, entry
from hsx.extract.follow import unchanged
from hsx.extract.options import ExtractOptions
from hsx.job.options import set_threads
from hsx.job.prologue import Prologue, locked
from hsx.job.resume import Summary, Verifier
from hsx.plan import load_plan
from hsx.progress import Progress
from hsx.spec import RunSpec
from hsx.store.scan import ShardScan

if TYPE_CHECKING:
    from hsx.extract.backends import Peers


class InProcess:
    """This process runs the whole job; ``peers``: the other ranks of its tensor-parallel group, told
    when to load the model and which batch comes next (None: a process alone)."""

    def __init__(self, peers: Peers | None = None):
        self.peers = peers

    def run(self, opts: ExtractOptions, spec: RunSpec, log: Callable[[str], None] = print) -> Summary:
        run = opts.out
        progress = Progress(spec.plan.num_samples, spec.plan.num_tokens, spec.bytes_per_token, run, opts.log_every)
        with locked(opts, progress.metrics, log) as lock:
            unchanged(run, spec)
            registry.settle(run, lock.me, log)  # workers of a crashed scale-out driver: gone first
            plan = load_plan(run, spec)
            begun = Prologue.open(opts, spec, plan.lengths, log, measure_first=True)
            summary, headers = begun.summary, begun.headers
            progress.start(0, 0)
            verifier = begun.verify(progress.add_done)
            summary.verified = verifier.stats
            progress.verified = verifier.stats.metrics
            try:
                how = entry(spec.backend)
                todo: Iterable[ShardScan] = verifier.todo()  # the shards that miss samples, as they are settled
                work = True  # the headers say something is missing: load the model now, beside verification
                if all(s.complete for s in headers) or how.whole:
                    todo = verifier.rest()  # nothing missing (or a backend that takes its work whole): no model yet
                    work = bool(todo)
                if work:
                    model_dir = target.model_dir_for(run, spec, opts.model, checked=opts.model is not None)
                    resources = opts.resources()
                    set_threads(resources.threads, resources.device)
                    session = Session(
                        run, spec, plan, model_dir, resources, progress, begun.space, log,
                        opts.tensor_parallel_size or 1, opts.data_parallel_size or 1, self.peers,
                    )  # fmt: skip
                    backend(spec.backend).run(session, todo)  # torch or vLLM: imported only when there is work
                    if not how.whole:
                        _log_verified(verifier, log)
            except DiskFull as e:
                summary.written, summary.tokens_written, summary.bytes_written = progress.session()
                raise begun.clean_stop(summary, e.path, e.reason) from e
            finally:
                verifier.stop()
                summary.seconds = progress.elapsed()
                summary.written, summary.tokens_written, summary.bytes_written = progress.session()
                summary.waited_for_disk = progress.waited_for_disk() if progress.waited_for_disk else 0.0
            return summary


def _log_verified(verifier: Verifier, log: Callable[[str], None]) -> None:
    v = verifier.stats
    if v.files:
        log(
            f"verified {v.files:,} files ({v.bytes / 1e9:,.2f} GB) in {v.seconds:.1f}s at {v.rate / 1e9:.2f} GB/s; "
            f"extraction waited {v.waited:.1f}s for it"
        )
