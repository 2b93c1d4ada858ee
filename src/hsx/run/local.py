"""The single-process job: open the run, take its lock, check the headers and the space, then load
the model and extract while the digests are verified (``run.resume.Verifier``): every shard that
is not complete is extracted, once its own scan is settled, and sealed.

The model is loaded only when something is missing: a resume that finds every file in place
verifies them and loads nothing, and loads the model afterwards only if a digest was bad."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hsx import registry, target
from hsx.assess import volume
from hsx.errors import CleanStop, DiskFull, LowSpace
from hsx.lock import RunLock
from hsx.plan import load_plan
from hsx.progress import Progress
from hsx.run.folder import open_run, record_model, remove_stray_temps
from hsx.run.options import ExtractOptions, set_threads
from hsx.run.resume import Summary, Verifier, scan_all
from hsx.spec import RunSpec
from hsx.store.scan import ShardScan

if TYPE_CHECKING:
    from hsx.run.pipeline import Peers


def extract_local(
    opts: ExtractOptions, log: Callable[[str], None] = print, spec: RunSpec | None = None, peers: Peers | None = None
) -> Summary:
    """``hsx extract`` in this process: a new run, or the resume of one, to the end or a clean stop.

    ``spec``: the run's, already opened by the caller; ``peers``: the other ranks of this process's
    tensor-parallel group (run.group), told when to load the model and which batch comes next."""
    spec = spec or open_run(opts, log)
    run = opts.out
    progress = Progress(spec.plan.num_samples, spec.plan.num_tokens, spec.bytes_per_token)
    telemetry = opts.telemetry(progress.metrics)
    with telemetry, RunLock(run, on_beat=telemetry.beat, warn=log) as lock:
        registry.settle(run, lock.me, log)  # workers of a crashed scale-out driver: gone first
        remove_stray_temps(run)
        record_model(opts, spec, log)
        plan = load_plan(run, spec)
        summary = Summary.of(run, spec)
        headers = scan_all(run, spec, deep=False)  # seconds: sealed shards are trusted by their listing
        space = volume.plan_space(
            run, spec, plan.lengths, headers, opts.allow_partial, opts.reserve_bytes, log, measure_first=True
        )
        reserve = space.reserve
        progress.start(0, 0)

        def done(scan: ShardScan) -> None:
            progress.add_done(len(scan.good), int(plan.lengths[list(scan.good)].sum()) if scan.good else 0)

        verifier = Verifier(run, spec, headers, opts.deep_verify, summary, done).start()
        summary.verified = verifier.stats
        progress.verified = verifier.stats.metrics
        try:
            todo: Iterable[ShardScan] = verifier.todo()  # the shards that miss samples, as they are settled
            work = True  # the headers say something is missing: load the model now, beside verification
            if all(s.complete for s in headers) or spec.backend == "vllm":
                todo = verifier.rest()  # nothing missing (or vLLM, which takes its work whole): no model yet
                work = bool(todo)
            if work:
                resources = opts.resources()
                model_dir = target.model_dir_for(run, spec, opts.model, checked=opts.model is not None)
                if spec.backend == "vllm":
                    from hsx.capture.vllm import run_shards_vllm  # vLLM is optional

                    run_shards_vllm(
                        run, spec, plan, model_dir, todo, progress, reserve,
                        opts.tensor_parallel_size or 1, opts.data_parallel_size or 1, space.forecast,
                    )  # fmt: skip
                else:
                    from hsx.capture.memory import check_run
                    from hsx.run.pipeline import Extractor, open_backend  # torch: only when there is work

                    check_run(spec, model_dir, resources.device, log)  # before any rank loads a weight
                    if peers is not None:
                        peers.load()
                    set_threads(opts.threads, resources.device)
                    backend = open_backend(spec, model_dir, resources.device)
                    extractor = Extractor(
                        run, spec, plan, backend, resources, progress, reserve, peers=peers, forecast=space.forecast
                    )
                    try:
                        extractor.run_shards(todo)
                    finally:
                        extractor.close()
                    _log_verified(verifier, log)
        except DiskFull as e:
            summary.written, summary.tokens_written, summary.bytes_written = progress.session()
            left = spec.plan.num_tokens - progress.tokens_done()
            reason = str(e) if isinstance(e, LowSpace) else None
            needed = volume.projected_bytes(left, 0, spec.bytes_per_token, space.forecast.ratio())
            raise CleanStop(summary, needed, e.path, reason) from e
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
