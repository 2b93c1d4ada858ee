"""One process's capture -> store pipeline: backend -> staging (device-to-host) -> writer threads;
the transformers backend's side of the extraction (``extract.backends``: ``final_state``, ``run``).

The same ``Extractor`` serves the local job and every scale-out worker, so every process writes a
shard the same way: the plan fixes the batches, a redone sample is computed in the same batch as
in an uninterrupted run, and its tensors are bit-identical (invariant 7). The disk guard runs
before each batch is captured, counting the writer's queued bytes as already spent.

Where the run checks its fidelity (``hsx.fidelity``) and its taps (``hsx.certify``), each batch's
figures are measured on the device with its states, and its files go to the writer only once the
gates have passed them, one
batch behind: the next batch is already captured (queued on the GPU) when a batch is judged, so the
device never waits for the verdict, and a batch that fails it is never written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from hsx import certify, fidelity
from hsx.capture import Capture, CapturedBatch
from hsx.capture.memory import check_run
from hsx.capture.stages import Stages
from hsx.capture.transformers import TransformersBackend
from hsx.errors import OptionError
from hsx.extract.backends import Peers, Resources, Session
from hsx.extract.window import Pause
from hsx.job.space import DiskGuard, Forecast
from hsx.plan import Plan
from hsx.progress import Progress
from hsx.spec import RunSpec
from hsx.staging import HostBatch, Staging, staging_for
from hsx.store.codec import Codec
from hsx.store.format import FINAL_STATES, FinalStateNorm, SampleTensors
from hsx.store.scan import ShardScan
from hsx.store.writer import FileRecord, SampleWriter, seal
from hsx.teacher import Teacher, Work, work_for


def open_backend(spec: RunSpec, model_dir: Path, device: str, stages: Stages | None = None) -> TransformersBackend:
    """The run's model with its capture hooks, laid out as the spec says (packed, compiled, its
    share of a tensor-parallel group; ``stages``: this rank's stage of a pipeline)."""
    p = spec.parallel
    backend = TransformersBackend.load(
        model_dir,
        spec.layers,
        spec.dtype,
        device,
        spec.packed,
        spec.trust_remote_code,
        spec.compiled,
        p.tensor,
        p.expert,
        spec.quantized_compute or "dequantized",
        spec.final_norm == "pre",
        stages,
        spec.expert_slice_gb,
    )
    backend.certifies(spec.certify)
    return backend


class Extractor:
    """Captures a shard's missing samples batch by batch and hands them to the writer.

    ``reserve``: bytes of free space to keep (None: no guard); the guard is the first of ``gates``,
    called before each batch is captured. ``staging``: a ring to share
    (the benchmark reuses one across variants); by default one is made for the backend's device and
    the run's codec (fp8: encoded on the device, before the copy).
    ``peers``: the other ranks of a tensor-parallel group, which compute every batch with us.
    ``forecast``: the start's space forecast (``job.space.plan_space``) for the disk guard; it is
    bound to ``progress`` here, so its ratio counts this session's files. ``log``: the fidelity
    gate's lines (a baseline set) and, in a run with a ``--window`` (``spec.window``), its pause at
    its gate (``extract.window.Pause``)."""

    def __init__(
        self,
        run: Path,
        spec: RunSpec,
        plan: Plan,
        backend: Capture,
        resources: Resources,
        progress: Progress,
        reserve: int | None = None,
        staging: Staging | None = None,
        peers: Peers | None = None,
        forecast: Forecast | None = None,
        log: Callable[[str], None] = print,
    ):
        self.run, self.spec, self.plan, self.backend, self.progress = run, spec, plan, backend, progress
        self.gate = None if spec.fidelity is None else fidelity.Gate(run, spec.fidelity, log)
        if self.gate is not None:
            progress.fidelity = self.gate.metrics
        names = certify.tap_names(spec.layers)
        self.taps = None if spec.certify is None else certify.Gate(run, names, log)
        self.peers = peers
        self.teacher = Teacher.of_run(run, spec.teacher)
        if self.teacher is not None and hasattr(backend, "stream"):  # a new run refuses it (extract.folder)
            raise OptionError("a pipeline of stages does not compute the target's teacher rows (--teacher)")
        width = len(spec.layers) * spec.model.hidden_size
        self.staging = staging or staging_for(
            backend.device,
            backend.dtype,
            width,
            spec.model.hidden_size,
            max(spec.batch_tokens, spec.max_length),
            resources.max_inflight_bytes,
            spec.codec,
        )
        if self.staging.encodes not in (Codec.RAW, spec.codec):
            raise ValueError(f"a staging ring that encodes {self.staging.encodes} cannot serve a {spec.codec} run")
        self.writer = SampleWriter(
            run,
            spec.shard_size,
            spec.layers,
            resources.writers,
            resources.max_inflight_bytes,
            codec=spec.codec,
            final=spec.final_norm,
        )
        # queued bytes not yet on disk count against free space
        # the codec's ratio from the files this session writes (and a resume's, in ``forecast``)
        self.forecast = forecast or Forecast(spec)
        self.forecast.session = progress.session
        # captured bytes not yet handed to the writer (a batch awaiting its verdict, a pipeline's batches
        # in flight): the guard counts them as spent too
        self.in_flight = 0
        # called with a batch's raw bytes before it is captured (fidelity's ``gate`` judges it after):
        # each may stop the work (the disk guard's LowSpace) or hold it (the window's pause waits here)
        self.gates: list[Callable[[int], None]] = []
        self.next_shard = 0  # the shard of the batch the gates are asked about
        self.unwritten: set[int] = set()  # ids of batches past the gates not yet handed to the writer
        if reserve is not None:
            self.gates.append(DiskGuard(run, reserve, lambda: self.writer.inflight + self.in_flight, self.forecast))
        if spec.window is not None:  # after the guard: a full disk stops the run even while it would wait
            self.gates.append(Pause(run, spec.window, spec.shard_size, log, lambda: (self.next_shard, self.unwritten)))
        self.sealing_waited = 0.0
        progress.waited_for_disk = self.waited_for_disk

    def waited_for_disk(self) -> float:
        """Seconds the forward pass stood still because writes were behind: for a staging slot, for
        room in the writer's queue, or for a shard's writes to be durable before its seal (the
        last shard's too: the run ends when its files are on disk)."""
        return self.staging.waited + self.writer.waited + self.sealing_waited

    def shard(self, scan: ShardScan) -> list[Future]:
        """Capture and submit every missing sample of one shard; returns the futures to wait on."""
        futures: list[Future] = []
        for _, submitted in self._judged([scan], seal_empty=False):
            futures += submitted
        return futures

    def _batches(
        self, scans: Iterable[ShardScan], seal_empty: bool
    ) -> Iterator[tuple[tuple, list[int], list, list | None, Work | None]]:
        """Each shard's batches that hold a missing sample, in the plan's order, once the gates let
        them through: ((scan, its missing ids, how many of its batches follow), ids, sequences, the
        positions the fidelity check takes, the teacher's work). ``seal_empty``: a shard with none is
        sealed as it is (else its caller seals it)."""
        for scan in scans:
            missing = set(scan.missing)
            batches = self.batches_of(scan)
            if not batches and seal_empty:
                self.finish(scan, [])
            for n, batch in enumerate(batches):
                ids = list(batch.ids)
                raw = sum(int(self.plan.lengths[i]) for i in missing.intersection(ids)) * self.spec.bytes_per_token
                self.next_shard = scan.shard
                for gate in self.gates:
                    gate(raw)
                if self.peers is not None:
                    self.peers.batch(ids)
                self.in_flight += raw
                self.unwritten |= missing.intersection(ids)
                checks = fidelity.checks_for(self.spec.fidelity, self.plan, ids)
                sequences = [self.plan.input_ids(i) for i in ids]
                yield (
                    (scan, missing, len(batches) - 1 - n),
                    ids,
                    sequences,
                    checks,
                    work_for(self.teacher, self.plan, ids),
                )

    def batches_of(self, scan: ShardScan) -> list:
        """The plan's batches of one shard that hold a missing sample: where its extraction begins."""
        missing = set(scan.missing)
        batches = self.plan.batches(scan.expected, self.spec.batch_tokens, self.spec.packed)
        return [b for b in batches if not missing.isdisjoint(b.ids)]

    def _captured(self, scans: Iterable[ShardScan], seal_empty: bool) -> Iterator[tuple[tuple, CapturedBatch]]:
        """Every batch of ``scans`` captured, in order: one at a time, or through the backend's
        ``stream`` where it keeps several in flight (a pipeline, across shards)."""
        items = self._batches(scans, seal_empty)
        stream = getattr(self.backend, "stream", None)
        if stream is None:
            stream = ((key, self.backend.capture(ids, seqs, checks, teach)) for key, ids, seqs, checks, teach in items)
        else:  # a pipeline computes no teacher (refused in __init__)
            stream = stream((key, ids, seqs, checks) for key, ids, seqs, checks, _ in items)
        for key, captured in stream:
            if self.peers is not None:
                self.peers.agree(captured)
            yield key, captured

    def _judged(self, scans: Iterable[ShardScan], seal_empty: bool = True) -> Iterator[tuple[tuple, list[Future]]]:
        """Every captured batch's missing samples handed to the writer once the fidelity gate passed
        them, one batch behind (the next is already queued on the device): (its key, their futures).
        A batch stopped before its verdict is dropped, never written."""
        staged: list[tuple[tuple, CapturedBatch, list[int], HostBatch]] = []  # captured, not yet judged
        try:
            for key, captured in self._captured(scans, seal_empty):
                wanted = [row for row, sid in enumerate(captured.sample_ids) if sid in key[1]]
                staged.append((key, captured, wanted, self.staging.stage(captured, wanted)))
                if len(staged) > 1:
                    judged, *batch = staged.pop(0)
                    yield judged, self._submit(*batch)
            while staged:
                judged, *batch = staged.pop(0)
                yield judged, self._submit(*batch)
        finally:
            for _, captured, wanted, host in staged:
                host.drop()
                self.in_flight -= self._bytes(captured, wanted)
                self.unwritten.difference_update(captured.sample_ids[row] for row in wanted)

    def _bytes(self, captured: CapturedBatch, wanted: list[int]) -> int:
        return sum(captured.lengths[row] for row in wanted) * self.spec.bytes_per_token

    def _submit(self, captured: CapturedBatch, wanted: list[int], host: HostBatch) -> list[Future]:
        """Hand a captured batch's wanted samples to the writer, once the gate has passed its figures."""
        self.in_flight -= self._bytes(captured, wanted)
        self.unwritten.difference_update(captured.sample_ids[row] for row in wanted)
        figures = taps = None
        try:
            if self.gate is not None and host.figures is not None:
                host.ready()
                figures = fidelity.figures(host.figures)
                self.gate.judge(captured.sample_ids, figures)
            if self.taps is not None and host.taps is not None:
                host.ready()
                taps = certify.figures(host.taps.numpy(), captured.lengths, self.spec.model.hidden_size)
                self.taps.judge(captured.sample_ids, taps)
        except BaseException:
            host.drop()
            raise
        futures = []
        for n, (row, (aux, final)) in enumerate(zip(wanted, host.views, strict=True)):
            sid = captured.sample_ids[row]
            sample = SampleTensors(
                sample_id=sid,
                input_ids=torch.from_numpy(self.plan.input_ids(sid).astype("int64")),
                loss_mask=torch.from_numpy(self.plan.loss_mask(sid).astype("uint8")),
                aux=aux,
                final=final,
                fidelity=None if figures is None else figures[row],
                teacher=None if host.teacher is None else host.teacher[n],
                teacher_info=None if self.teacher is None else self.teacher.info,
                taps=None if taps is None else taps[row].text(),
            )
            fut = self.writer.submit(sample, release=host.done_one, ready=host.ready)
            fut.add_done_callback(self.progress.on_written(captured.lengths[row]))
            futures.append(fut)
        return futures

    def finish(self, scan: ShardScan, futures: list[Future]) -> list[FileRecord]:
        """Wait until a shard's writes are durable, then seal it (its old good files + the new ones)."""
        t0 = time.perf_counter()
        records: list[FileRecord] = self.writer.wait(futures)
        self.sealing_waited += time.perf_counter() - t0
        seal(self.run, scan.shard, list(scan.good.values()) + records)
        return records

    def run_shards(self, todo: Iterable[ShardScan]) -> None:
        """Every shard of ``todo``, sealing one shard behind so the device never waits on fsync (and
        a pipeline's batches in flight cross from one shard to the next)."""
        pending: list[tuple[ShardScan, list[Future]]] = []
        writing: list[Future] = []
        for (scan, _, left), submitted in self._judged(todo):
            writing += submitted
            if left == 0:
                pending.append((scan, writing))
                writing = []
            while len(pending) > 1:
                self.finish(*pending.pop(0))
        while pending:
            self.finish(*pending.pop(0))

    def close(self) -> None:
        """Stop staging; in-flight writes complete or remove their temp files; folders fsynced."""
        self.staging.close()
        self.writer.close()
        self.writer.sync()


def final_state(model_dir: Path, norm: FinalStateNorm) -> str:
    """The transformers backend's final state: ``last_hidden_state``, after the model's own norm, or
    the norm's input (the last layer's raw output). Where the model divides the normed state before
    its LM head (Inkling), the label says so: the state stored is the head's input."""
    from hsx.finalnorm import head_divisor
    from hsx.target import load_config

    divisor = head_divisor(load_config(model_dir))
    if norm == "post" and divisor != 1.0:
        return f"{FINAL_STATES[norm]}, divided by logits_mup_width_multiplier {divisor:g}: the LM head's input"
    return FINAL_STATES[norm]


def run(session: Session, todo: Iterable[ShardScan]) -> None:
    """Every missing sample of ``todo``, shard by shard as verification settles them: the layout
    checked against the devices' memory before any rank loads a weight, then the model loaded
    (with the group's other ranks) and extracted through ``Extractor``."""
    s = session
    check_run(s.spec, s.model_dir, s.resources.device, s.log)
    if s.peers is not None:
        s.peers.load()
    opened = s.peers.open if s.peers is not None else open_backend
    backend = opened(s.spec, s.model_dir, s.resources.device)
    extractor = Extractor(
        s.run, s.spec, s.plan, backend, s.resources, s.progress, s.space.reserve, peers=s.peers,
        forecast=s.space.forecast, log=s.log,
    )  # fmt: skip
    with s.progress.live():  # its last line after the writes in flight end: at a stop, what is durable
        try:
            extractor.run_shards(todo)
        finally:
            extractor.close()
