"""``hsx extract --workers N [--ray-address ADDR]``: one run extracted by N Ray workers (``Workers``,
an executor of ``extract.executor``).

The driver does what a single-process extractor does around the loop: hold the run lock (so a
second driver, or a plain extractor, is refused), check the space, and tally. The loop itself is
Ray Data over the run's shard ids: ``map_batches`` with a callable class (an actor pool of N, one
shard per call; each actor on one GPU, or on the N GPUs of its own tensor-parallel group:
``workers.group``). Placement, retries of a shard whose worker died (Ray restarts the actor), and
backpressure are Ray's; redoing a shard is idempotent because a worker redoes it as a resume would;
each shard's ``Outcome`` comes back as the dataset's row. Nothing here needs Ray core actors.

Shards go out unsealed first; with digest verification on (the default) sealed shards follow, so
the workers verify them in parallel instead of the driver reading the whole run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from hsx import registry
from hsx.errors import Locked, Refused, WorkerFailed, no_space
from hsx.extract.options import ExtractOptions
from hsx.extract.outcome import Outcome
from hsx.extract.stage import Extract
from hsx.extract.summary import ExtractSummary
from hsx.extract.window import sweep
from hsx.extract.workers.actor import ShardWorker
from hsx.extract.workers.worker import WorkerTask
from hsx.job.model import Model
from hsx.job.space import largest_batch_bytes
from hsx.job.stage import Job, session
from hsx.lock import BEAT_EVERY, Liveness, RunLock, read_holder
from hsx.progress import Progress
from hsx.spec import RunSpec

MAX_SHARD_RETRIES = 3  # a shard whose worker dies this many more times (an OOM-kill loop) fails the run
CPUS_PER_WORKER = 1  # Ray's logical CPUs per worker: scheduling only; the writer threads are not bound by it
OBJECT_STORE = 200 << 20  # local Ray: rows are a few hundred bytes; the default takes 30% of RAM
PASS_ENV = ("HF_", "TRANSFORMERS_", "HSX_", "TORCH_", "PYTORCH_")  # driver env the workers get


def import_ray():
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise Refused(f"--workers runs on Ray, which does not import here ({e}): pip install 'hsx[ray]'") from None
    return ray


def _short_tempdir() -> str:
    """Ray puts AF_UNIX sockets under its temp dir: their paths must stay under 108 bytes."""
    base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="hsx-ray-", dir=base if len(base) <= 40 else "/tmp")


class Cluster:
    """The Ray cluster at ``--ray-address``, or a local Ray started for this run; ``stop`` ends this
    driver's use of it (Ray then ends the job's workers) and, for a local Ray, Ray itself."""

    def __init__(self, opts: ExtractOptions, log: Callable[[str], None]):
        ray = import_ray()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env = {k: v for k, v in os.environ.items() if k.startswith(PASS_ENV)}
        runtime_env = {"env_vars": env} if env else None
        self.address, self.temp = opts.ray_address, None
        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        if opts.ray_address:
            ray.init(address=opts.ray_address, log_to_driver=False, runtime_env=runtime_env)
        else:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            self.temp = _short_tempdir()
            ray.init(
                num_cpus=max(os.cpu_count() or 1, opts.workers * CPUS_PER_WORKER),
                include_dashboard=False,
                object_store_memory=OBJECT_STORE,
                _temp_dir=self.temp,
                log_to_driver=False,
                runtime_env=runtime_env,
            )
        self._stopped = False
        res = ray.cluster_resources()
        self.gpus, self.cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
        where = f"Ray cluster at {opts.ray_address}" if opts.ray_address else "a local Ray"
        log(f"{where}: {self.cpus} CPUs, {self.gpus} GPUs")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        import ray

        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in self._before]
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=15)  # what the local Ray started, by pid
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)


@contextlib.contextmanager
def workers(opts: ExtractOptions, log: Callable[[str], None]) -> Iterator[tuple[ExtractOptions, Workers]]:
    """The Ray cluster, before the run is opened and until the job ends: its devices decide a new
    run's (a worker sees only its own GPUs); the options as they resolve there, and the executor."""
    if opts.workers < 1:
        raise Refused("--workers takes a number of workers >= 1")
    if opts.backend not in (None, "transformers"):
        raise Refused(f"--workers runs the transformers backend, not {opts.backend}")
    holder = read_holder(opts.out)
    if holder is not None and holder.state() == Liveness.ALIVE:  # refuse before spending seconds on Ray
        raise Locked(holder)
    cluster = Cluster(opts, log)
    try:
        gpu = (opts.device or ("cuda" if cluster.gpus else "cpu")).startswith("cuda")
        yield dataclasses.replace(opts, device="cuda" if gpu else "cpu"), Workers(cluster, gpu)
    finally:
        cluster.stop()


class Workers(Extract):
    """The executor of Ray workers (``extract.executor``): this process runs the job's session (the
    lock, the prologue: headers only) and its work hands whole shards to the workers, each shard's
    ``Outcome`` folded into the job's."""

    def __init__(self, cluster: Cluster, gpu: bool):
        self.cluster, self.gpu = cluster, gpu
        self.driver: str | None = None  # this driver's id, once it holds the lock

    def run(self, opts: ExtractOptions, spec: RunSpec, log: Callable[[str], None]) -> ExtractSummary:
        if spec.backend != "transformers":
            raise Refused(f"--workers runs the transformers backend; this run uses {spec.backend}: omit --workers")
        if spec.parallel.pipeline > 1:
            raise Refused(
                f"--workers runs workers of one GPU or of a tensor-parallel group; this run is a pipeline "
                f"({spec.parallel}): omit --workers"
            )
        if self.gpu and self.cluster.gpus < opts.workers * spec.parallel.ranks:
            each = f" of {spec.parallel.ranks} GPUs each ({spec.parallel})" if spec.parallel.ranks > 1 else ""
            raise Refused(
                f"{opts.workers} GPU workers{each} asked for, but the Ray cluster has {self.cluster.gpus} GPUs"
            )
        return session(self, opts, spec, Model.of_run(opts.model, opts.trust_remote_code, opts.out, spec), log)

    def lock_command(self, opts: ExtractOptions) -> str:
        return f"extract --workers {opts.workers}"

    def progress(self, opts: ExtractOptions, spec: RunSpec) -> Progress:
        return _Tallied(spec, opts, self)

    def locked(self, opts: ExtractOptions, spec: RunSpec, lock: RunLock, log: Callable[[str], None]) -> None:
        self.driver = registry.driver_id(lock.me)
        super().locked(opts, spec, lock, log)

    def work(self, job: Job[ExtractOptions, RunSpec, ExtractSummary]) -> None:
        try:
            _extract(job, self.gpu)
            sweep(job.run, job.spec.window, job.spec.shard_size, job.log)
        finally:
            self.cluster.stop()  # no worker of this driver may outlive its lock
            job.progress.settle()  # the workers' last counts, before their records go
            for s in registry.clear_session(job.run, self.driver):
                if s.state in (Liveness.DEAD, Liveness.STALE):
                    job.log(f"during the run: {s.describe()}")


class _Tallied(Progress):
    """The driver's progress: the workers' counts, read from their heartbeat records whenever the
    lock's heartbeat writes the metrics (the driver writes no sample itself)."""

    def __init__(self, spec: RunSpec, opts: ExtractOptions, workers: Workers):
        super().__init__(spec.plan.num_samples, spec.plan.num_tokens, spec.bytes_per_token)
        self.out, self.workers, self.count = opts.out, workers, opts.workers
        self.settled = False

    def settle(self) -> None:
        """Keep the workers' last counts: their records are cleared next, and the run's final metrics
        (written after) would otherwise read none, and say nothing was done."""
        self.metrics()
        self.settled = True

    def metrics(self) -> dict:
        if self.workers.driver is not None and not self.settled:
            with self.lock:
                self.samples, self.tokens, self.bytes = registry.totals(self.out, self.workers.driver)
        return super().metrics() | {"workers": self.count}


def _extract(job: Job[ExtractOptions, RunSpec, ExtractSummary], gpu: bool) -> None:
    import ray

    opts, spec, plan, progress, log, run = job.opts, job.spec, job.plan, job.progress, job.log, job.run
    # headers only: what to hand out, the workers verify and settle; the workers' guards hold the
    # forecast: an unmeasured zstd run may start and be judged on its first files
    begun = job.begun
    summary, scans, space = begun.summary, begun.headers, begun.space
    todo = [s.shard for s in scans if not s.sealed]
    settled = [s for s in scans if s.sealed]
    if opts.deep_verify:
        todo += [s.shard for s in settled]
        settled = []
    summary.already_done = sum(len(s.accounted) for s in settled)
    # the pace and ETA count every file on disk, also those the workers re-verify (a digest they
    # find bad is counted again when redone: a slight overcount, never a whole run's undercount)
    on_disk = [i for s in scans for i in s.good]
    progress.start(len(on_disk), int(plan.lengths[on_disk].sum()))
    if not todo:
        return
    # each worker guards only its own writes in flight: keep room for the others' batches too
    batch = largest_batch_bytes(spec.batch_tokens, int(plan.lengths.max()), spec.bytes_per_token)
    task = WorkerTask(
        run=str(run),
        model=opts.model,
        resources=opts.resources(),
        deep_verify=opts.deep_verify,
        driver=job.lock.me.model_dump(),
        reserve=space.reserve + (opts.workers - 1) * batch,
        start=space.forecast.start,
    )

    ctx = ray.data.DataContext.get_current()
    ctx.execution_no_progress_timeout_s = -1  # loading a large model takes long; that is not a hang
    ctx.enable_progress_bars = False
    size = min(opts.workers, len(todo))
    with warnings.catch_warnings():  # max_task_retries has no named parameter in Ray 2.60
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        ds = ray.data.from_items([{"shard": s} for s in todo], override_num_blocks=len(todo)).map_batches(
            ShardWorker,
            fn_constructor_kwargs={"task": task},
            batch_size=1,
            batch_format="numpy",
            num_cpus=CPUS_PER_WORKER,
            num_gpus=spec.parallel.ranks if gpu else None,  # a tensor-parallel worker's group: N GPUs
            compute=ray.data.ActorPoolStrategy(size=size, max_tasks_in_flight_per_actor=1),
            max_task_retries=MAX_SHARD_RETRIES,  # a shard whose worker keeps dying fails the run, not loops
        )
    each = f", each a group of {spec.parallel.ranks} ranks ({spec.parallel})" if spec.parallel.ranks > 1 else ""
    log(f"extracting {len(todo)} shards with {size} {'GPU' if gpu else 'CPU'} workers{each}")
    watch = _Watch(run, registry.driver_id(job.lock.me), log, ends_process=_the_command())
    watch.start()
    stopped: Outcome | None = None  # the first shard that stopped the run: a full disk or a failure
    t0 = time.monotonic()
    span = [float("inf"), 0.0]  # first shard begun, last shard ended: the pool's working time
    try:
        for n, raw in enumerate(ds.iter_rows(), 1):
            done = Outcome.of_row(raw)
            where = done.shard
            if done.summary is None:  # skipped: the run is stopping
                continue
            span = [min(span[0], where.began), max(span[1], where.ended)]
            summary.add(done.summary)
            if done.stop is not None or done.failure is not None:
                if stopped is None:  # hand out no more work; shards in flight end cleanly
                    stopped = done
                    why = _why(done)
                    registry.request_stop(run, why)
                    log(f"stopping: shard {where.shard} on {where.host} (pid {where.pid}): {why}")
                continue
            gpus = f" GPU {where.gpus}" if where.gpus else ""
            log(
                f"shard {where.shard} sealed: {done.summary.written} written, {done.summary.already_done} kept "
                f"({where.host} pid {where.pid}{gpus}, {done.summary.seconds:.1f}s) [{n}/{len(todo)}]"
            )
    except KeyboardInterrupt:
        watch.heard.set()
        if watch.refused is not None:
            raise watch.refused from None
        if watch.lost is None:
            raise
        raise Locked(watch.lost) from None  # its workers fence themselves; this driver stops as well
    except Exception as e:  # Ray gave up: a shard's workers kept dying, or the cluster went away
        refused = registry.refusal(registry.inspect(run), watch.driver)  # say what, not "Ray gave up"
        if refused is not None:
            raise refused from None
        if stopped is None:
            raise WorkerFailed(
                f"Ray gave up on the run: {str(e).strip().splitlines()[-1]}\n"
                f"Verified work is kept; resume with: hsx extract --out {run} --workers {opts.workers}"
            ) from e
    finally:
        watch.stop()
        summary.seconds = time.monotonic() - t0
    if summary.written:
        work = max(span[1] - span[0], 1e-9)
        log(
            f"{size} workers: {summary.tokens_written / work:,.0f} tok/s while extracting ({work:.1f}s, from the "
            f"first shard begun to the last sealed); {summary.seconds:.1f}s with starting the workers"
        )
    if stopped is not None and stopped.stop is not None:  # the same clean stop as a process of its own
        raise begun.clean_stop(summary, Path(stopped.stop.path), stopped.stop.reason, stopped.stop.advice)
    if stopped is not None:
        where = stopped.shard
        raise WorkerFailed(
            f"worker pid {where.pid} on {where.host} failed on shard {where.shard}: {_why(stopped)}\n"
            f"Verified work is kept; fix the cause, then resume: hsx extract --out {run} --workers {opts.workers}"
        )


def _why(done: Outcome) -> str:
    """What stopped a shard, in a line."""
    if done.stop is not None:
        return done.stop.reason or no_space(done.stop.path)
    return f"{done.failure.error}: {done.failure.message}"


def _the_command() -> bool:
    """Whether this process is the hsx command itself (``hsx``, ``python -m hsx``), not a program
    calling hsx's API, whose process the driver's watch must never end."""
    argv0 = Path(sys.argv[0])
    return argv0.name == "hsx" or (argv0.name == "__main__.py" and argv0.parent.name == "hsx")


UNHEARD_S = 12 * BEAT_EVERY  # how long the watch's interrupts may go unheard before it ends the driver itself


class _Watch:
    """Says so when a worker of this session dies (Ray restarts it and retries its shard); stops
    the driver when another extractor has taken the run over (``Locked``), or when a worker refused
    at load (the model on its node, its checkpoint format), which no restart would mend."""

    def __init__(self, run: Path, driver: str, log: Callable[[str], None], ends_process: bool = False):
        self.run, self.driver, self.log = run, driver, log
        self.ends_process = ends_process  # the hsx command's own process: may end it where it goes unheard
        self.reported: set[str] = set()
        self.lost: object | None = None  # who holds the run lock now, once this driver lost it
        self.refused: Refused | None = None  # a worker's refusal at load
        self.heard = threading.Event()  # the main thread caught the interrupt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hsx-worker-watch", daemon=True)

    def _loop(self) -> None:
        misses = 0
        told: float | None = None  # when the main thread was first interrupted
        while not self._stop.wait(BEAT_EVERY / 2):
            if self.lost is not None or self.refused is not None:
                if not self.heard.is_set():
                    told = told or time.monotonic()
                    if self.ends_process and time.monotonic() - told > UNHEARD_S:
                        self._exit()
                    self._interrupt()  # again, until heard: an interrupt is never lost to a busy moment
                continue
            # another extractor took the run over (this driver's lock went stale): the workers fence
            # themselves, and Ray would restart them without end, each fenced at its start; stop the
            # driver too (two checks in a row, like the workers' fence)
            misses = 0 if registry.driver_holds(self.run, self.driver) else misses + 1
            if misses >= 2:
                self.lost = read_holder(self.run) or _NoHolder()
                self._interrupt()
                continue
            seen = registry.inspect(self.run)
            self.refused = registry.refusal(seen, self.driver)
            if self.refused is not None:
                self._interrupt()
                continue
            for s in seen:
                if (
                    s.record.driver != self.driver
                    or s.state not in (Liveness.DEAD, Liveness.STALE)
                    or s.path.name in self.reported
                ):
                    continue
                self.reported.add(s.path.name)
                r = s.record
                what = f"holding shard {r.shard}; Ray retries the shard" if r.shard is not None else f"while {r.phase}"
                self.log(f"worker {r.where()} died {what} on a restarted worker")

    def _exit(self) -> None:
        """The main thread stayed inside Ray's own code (which checks for signals only between its
        calls) while Ray restarted fenced or refused workers without end: say why, and end the
        process (the hsx command's only) with the code the main thread would have given; its local
        Ray goes with it."""
        error = self.refused if self.refused is not None else Locked(self.lost)
        self.log(f"{error} (the driver's main thread did not come back from Ray within {UNHEARD_S:.0f} s: it exits)")
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(error.exit_code)

    @staticmethod
    def _interrupt() -> None:
        """KeyboardInterrupt in the main thread by a real SIGINT: ``_thread.interrupt_main`` only
        sets a flag, which a main thread blocked in a wait without timeout never looks at."""
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _NoHolder:
    """The run lock is gone (removed by hand): what ``Locked`` says then."""

    def describe(self) -> str:
        return "no one (the run lock was removed)"
