"""One model replica over N devices of this node: a tensor-parallel group whose rank 0 writes.

    launcher: PyTorch's elastic agent, in the calling thread (``hsx extract``, or a scale-out worker)
      rank 0      its lead: the in-process job (``local.InProcess``: lock, resume, disk guard,
                  capture -> staging -> writer), or a scale-out worker's shards (``workers.group``)
      rank 1..N-1 load their share of the model, then capture each batch rank 0 names; write nothing

Every rank computes every batch, since TP and EP collectives need all of them; after each decoder
layer the residual stream is replicated, so rank 0's copy is the whole capture (the first batch
of every session checks it: every rank's digest of its capture must equal rank 0's). Rank 0 tells
the others, over a gloo control group, when to load the model and which batch comes next; the end
of its lead (the job's end, a clean stop, a refusal) ends them too.

No rank outlives the group: the agent stops every rank when one fails, and a rank whose launcher
died is killed by the kernel (PR_SET_PDEATHSIG). What crosses processes is JSON text: the options
or task in, rank 0's ``extract.outcome.Outcome`` out.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import xxhash
from pydantic import TypeAdapter

from hsx import errors, fidelity, interconnect, registry, target
from hsx.capture import Capture, CapturedBatch
from hsx.errors import WorkerFailed
from hsx.extract.backends import Resources
from hsx.extract.local import InProcess
from hsx.extract.options import ExtractOptions, check_gpus
from hsx.extract.outcome import Outcome
from hsx.extract.pipeline import open_backend
from hsx.extract.summary import ExtractSummary
from hsx.job.options import resume_command
from hsx.launch import local_ranks
from hsx.plan import load_plan
from hsx.spec import RunSpec
from hsx.store.format import digest_text
from hsx.store.scan import scan_run
from hsx.teacher import Teacher, work_for

WAIT = dt.timedelta(days=7)  # the others wait on rank 0 through a whole verification of terabytes
STUCK_S = 10.0  # after SIGTERM, how long a rank may stay blocked (a collective that never ends) before it exits
STUCK_EXIT = 143  # its exit status then: 128 + SIGTERM, as a process the signal ended
STOP, LOAD, BATCH = 0, 1, 2
OPTIONS = TypeAdapter(ExtractOptions)
RESOURCES = TypeAdapter(Resources)


class Group:
    """The executor of a tensor/expert-parallel group of this node's devices: rank 0 runs the job in
    its process (``local.InProcess``) with the other ranks as its peers; its ``Outcome`` is raised
    or returned here as if it had happened here."""

    def run(self, opts: ExtractOptions, spec: RunSpec, log: Callable[[str], None] = print) -> ExtractSummary:
        return run_job(opts, spec, log, _lead_local)


def run_job(
    opts: ExtractOptions,
    spec: RunSpec,
    log: Callable[[str], None],
    lead: Lead,
    follow: Follow | None = None,
    lead_rank: int = 0,
) -> ExtractSummary:
    """An extraction over this node's ranks (``run_group``: a tensor-parallel group, or a pipeline's
    stages), its lead running the in-process job on ``opts``: the lead's ``Outcome`` raised or
    returned here as if it had happened here. The interconnect is measured first: a slow ring is
    named before days are spent on it."""
    resources = opts.resources()
    interconnect.before_job(opts.out, spec.parallel.ranks, resources.device, log)
    log(f"starting {spec.parallel.ranks} ranks ({spec.parallel}) on {resources.device}")
    options = OPTIONS.dump_json(opts).decode()
    result = run_group(spec, resources, opts.out, opts.model, lead, options, follow, lead_rank)
    return Outcome.load(result).result()


Lead = Callable[["Leader", RunSpec, str], str]  # the lead's job: (its peers, the spec, its payload) -> its outcome
# the others: (run, model, spec, device, control group, the lead's rank, the payload) -> None
Follow = Callable[[Path, "str | None", RunSpec, str, object, int, str], None]


def run_group(
    spec: RunSpec,
    resources: Resources,
    run: Path,
    model: str | None,
    lead: Lead,
    payload: str,
    follow: Follow | None = None,
    lead_rank: int = 0,
) -> str:
    """Launch ``spec.parallel.ranks`` ranks under PyTorch's elastic agent in this thread, until
    they end, each on ``resources`` (``rank_device``). Rank ``lead_rank`` runs ``lead(leader, spec,
    payload)`` and its return value is returned here; the others run ``follow`` (by default:
    capture each batch the lead names). Both are module-level functions: they cross to the spawned
    ranks by name. Raises ``WorkerFailed`` naming the ranks that failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    n = spec.parallel.ranks
    if resources.device.startswith("cuda"):
        check_gpus(spec.parallel, torch.cuda.device_count())
    try:
        entry = local_ranks(n, rank_main, f"hsx-{os.getpid()}-{threading.get_ident()}")
        on = RESOURCES.dump_json(resources).decode()
        results = entry(
            lead, follow or _follow, lead_rank, str(run), model, on, spec.model_dump_json(), payload, os.getpid()
        )
    except ChildFailedError as e:  # the agent stopped every other rank; what they wrote is durable
        raise WorkerFailed(
            f"the group of {n} ranks ({spec.parallel}) failed: {_failures(e)}; {_durable(run, spec)}; "
            f"once the cause is fixed, resume with: {resume_command(run, model)}"
        ) from None
    except SignalException as e:  # SIGTERM to the launcher: the agent stopped every rank, which stop cleanly
        registry.clear_group(run)  # no rank is left of it
        stop = errors.Terminated() if e.sigval == signal.SIGTERM else KeyboardInterrupt()
        stop.add_note(_durable(run, spec))
        raise stop from None
    return results[lead_rank]


def _durable(run: Path, spec: RunSpec) -> str:
    """How many of the run's samples are on disk and good, in words: what a stopped group leaves."""
    done = sum(len(s.good) for s in scan_run(run, spec.plan.num_samples, spec.shard_size, deep=False))
    return f"{done}/{spec.plan.num_samples} samples are done and durable"


def rank_main(
    lead: Lead,
    follow: Follow,
    lead_rank: int,
    run: str,
    model: str | None,
    resources: str,
    run_spec: str,
    payload: str,
    launcher: int,
) -> str:
    """One rank's life (the agent's entry point); returns the lead's outcome. SIGTERM (the agent
    passes on the one its launcher got) stops it as it stops one process: writes in flight end whole."""
    _die_with(launcher)
    stop_on_sigterm()
    spec = RunSpec.model_validate_json(run_spec)
    rank, local, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = rank_device(RESOURCES.validate_json(resources), local, world)
    cuda = device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=WAIT, device_id=torch.device(device) if cuda else None)
    control = dist.new_group(backend="gloo", timeout=WAIT)
    try:
        ranks = _gather_ranks(control, device)
        if rank == lead_rank:
            leader = Leader(control, ranks, lead_rank)
            try:
                return lead(leader, spec, payload)
            finally:
                leader.stop()
        follow(Path(run), model, spec, device, control, lead_rank, payload)
        return ""
    finally:
        dist.destroy_process_group()


def stop_on_sigterm(stuck_s: float = STUCK_S) -> None:
    """A rank's SIGTERM (or SIGINT): ``Terminated`` in the main thread, for the clean stop. Python runs that
    handler only once the main thread is back in Python, and a rank blocked in a collective whose
    peer is stopped or gone never is: it would sit there until the agent's SIGKILL, 30 s on. So the
    signal also wakes a thread (through Python's wakeup fd, written at C level), which ends the
    process if it is still there ``stuck_s`` later. Either way what it wrote is durable: a rank
    killed at any point is what the resume is built for."""
    signal.signal(signal.SIGTERM, _terminated)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        while not {signal.SIGTERM, signal.SIGINT} & set(os.read(read, 64)):
            pass
        time.sleep(stuck_s)
        os._exit(STUCK_EXIT)

    threading.Thread(target=watch, name="hsx-sigterm", daemon=True).start()


def _terminated(signum: int, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise errors.Terminated()


def rank_device(resources: Resources, local: int, world: int) -> str:
    """This rank's device, made current. On CPU it sets the rank's torch threads: ``--threads`` where
    given, else a share of the cores (``world`` ranks each on torch's default, a thread per core,
    would oversubscribe them ``world`` times)."""
    if resources.device.startswith("cuda"):
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    torch.set_num_threads(resources.threads or max(1, (os.cpu_count() or 1) // world))
    return resources.device


class Leader:
    """The lead's side of the control channel (``backends.Peers``); ``ranks``: every rank's process;
    ``source``: the lead's rank (the writing rank: 0 in a tensor-parallel group)."""

    def __init__(self, control, ranks: list[registry.Rank], source: int = 0):
        self.control, self.ranks, self.source = control, ranks, source
        self.stopped = self.agreed = False

    def load(self) -> None:
        _send(self.control, LOAD, source=self.source)

    def open(self, spec: RunSpec, model_dir: Path, device: str) -> Capture:
        return open_backend(spec, model_dir, device)

    def batch(self, ids: list[int]) -> None:
        _send(self.control, BATCH, ids)

    def agree(self, captured: CapturedBatch) -> None:
        if not self.agreed:
            same = _agree(self.control, captured)
            print(f"ranks 0-{dist.get_world_size() - 1} captured the same states on the first batch ({same})")
            self.agreed = True

    def stop(self) -> None:
        if not self.stopped:
            _send(self.control, STOP, source=self.source)
            self.stopped = True


def _lead_local(leader: Leader, spec: RunSpec, options: str) -> str:
    """Rank 0 of ``hsx extract --tensor-parallel N``: ``lead_job`` with the other ranks as its peers."""
    return lead_job(leader, spec, OPTIONS.validate_json(options))


def lead_job(leader: Leader, spec: RunSpec, opts: ExtractOptions) -> str:
    """The lead of a group: the in-process job, with the other ranks as its ``peers``, recorded in
    the run folder (``hsx status`` shows them alive or dead); its ``Outcome``."""
    launcher = os.getppid()
    record = registry.GroupRecord(
        host=socket.gethostname(),
        launcher=launcher,
        launcher_started=psutil.Process(launcher).create_time(),
        started=time.time(),
        ranks=leader.ranks,
    )
    registry.write_group(opts.out, record)
    try:
        outcome = Outcome.of(lambda: InProcess(peers=leader).run(opts, spec))
    finally:
        leader.stop()  # before the record goes: a rank seen gone is then really done
    registry.clear_group(opts.out)
    return outcome.dump()


def _follow(run: Path, model: str | None, spec: RunSpec, device: str, control, lead: int, payload: str) -> None:
    """Ranks 1..N-1 of a tensor-parallel group: load when told, capture each batch named, until told to stop."""
    kind, _ = receive(control)
    if kind == STOP:
        return
    plan = load_plan(run, spec)
    backend = open_backend(spec, target.model_dir_for(run, spec, model), device)
    teacher = Teacher.of_run(run, spec.teacher)
    agreed = False
    while True:
        kind, ids = receive(control)
        if kind == STOP:
            return
        checks = fidelity.checks_for(spec.fidelity, plan, ids)  # as rank 0's, and the teacher's rows
        captured = backend.capture(ids, [plan.input_ids(i) for i in ids], checks, work_for(teacher, plan, ids))
        if not agreed:
            _agree(control, captured)
            agreed = True


def _gather_ranks(control, device: str) -> list[registry.Rank]:
    """Every rank's pid, start time and device (a collective: all ranks call it)."""
    me = torch.tensor([os.getpid(), int(psutil.Process().create_time() * 1000)], dtype=torch.int64)
    gathered = [torch.zeros_like(me) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, me, group=control)
    return [
        registry.Rank(rank=r, pid=int(t[0]), pid_started=int(t[1]) / 1000, device=_device_of(device, r))
        for r, t in enumerate(gathered)
    ]


def _send(control, kind: int, ids: list[int] = (), source: int = 0) -> None:
    dist.broadcast(torch.tensor([kind, len(ids)], dtype=torch.int64), source, group=control)
    if ids:
        dist.broadcast(torch.tensor(ids, dtype=torch.int64), source, group=control)


def receive(control, source: int = 0) -> tuple[int, list[int]]:
    """What the lead (rank ``source``) told every rank: STOP, LOAD or BATCH, and a batch's ids."""
    head = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(head, source, group=control)
    kind, n = (int(v) for v in head)
    if not n:
        return kind, []
    ids = torch.zeros(n, dtype=torch.int64)
    dist.broadcast(ids, source, group=control)
    return kind, ids.tolist()


def capture_digest(captured: CapturedBatch) -> str:
    """A digest of every bit of a capture (aux and final states), to compare ranks' copies."""
    h = xxhash.xxh3_128()
    for t in (captured.aux, captured.final):
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy())
    return digest_text(h)


def _agree(control, captured: CapturedBatch) -> str:
    """Every rank's capture must equal rank 0's, bit for bit: the replication hsx relies on.
    Returns the digest they share."""
    ours = capture_digest(captured)
    mine = bytes.fromhex(ours.split(":", 1)[1])
    gathered = [torch.zeros(len(mine), dtype=torch.uint8) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.frombuffer(bytearray(mine), dtype=torch.uint8), group=control)
    differ = [r for r, t in enumerate(gathered) if not torch.equal(t, gathered[0])]
    if differ:
        raise errors.CaptureFailed(
            f"ranks {differ} captured other states than rank 0: the layer outputs are not replicated "
            "under this model's parallel plan, so hsx cannot take one rank's copy"
        )
    return ours


def _device_of(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device.startswith("cuda") else device


def _die_with(launcher: int) -> None:
    """Have the kernel kill this rank when its launcher dies (Linux); if it already has, go now."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:
        os._exit(1)


def _failures(e) -> str:
    """One line per failed rank, from the agent's report: exit code or signal."""
    parts = []
    for rank, f in sorted(e.failures.items()):
        how = f"killed by {signal.Signals(-f.exitcode).name}" if f.exitcode < 0 else f"exit code {f.exitcode}"
        parts.append(f"rank {rank} (pid {f.pid}) {how}")
    return "; ".join(parts) or str(e)
