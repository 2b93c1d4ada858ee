"""One process's capture -> store pipeline: backend -> staging (device-to-host) -> writer threads;
the transformers backend's side of the extraction (``extract.backends``: ``final_state``, ``run``).

The same ``Extractor`` serves the local job and every scale-out worker, so every process writes a
shard the same way: the plan fixes the batches, a redone sample is computed in the same batch as
in an uninterrupted run, and its tensors are bit-identical (invariant 7). The disk guard runs
before each batch is captured, counting the writer's queued bytes as already spent.

Where the run checks its fidelity (``hsx.fidelity``), each batch's figures are measured on the
device with its states, and its files go to the writer only once the gate has passed them, one
batch behind: the next batch is already captured (queued on the GPU) when a batch is judged, so the
device never waits for the verdict, and a batch that fails it is never written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path

import torch

from hsx import fidelity
from hsx.capture import Capture, CapturedBatch
from hsx.capture.memory import check_run
from hsx.capture.transformers import TransformersBackend
from hsx.extract.backends import Peers, Resources, Session
from hsx.job.space import DiskGuard, Forecast
from hsx.plan import Plan
from hsx.progress import Progress
from hsx.spec import RunSpec
from hsx.staging import HostBatch, Staging, staging_for
from hsx.store.codec import Codec
from hsx.store.format import FINAL_STATES, FinalStateNorm, SampleTensors
from hsx.store.scan import ShardScan
from hsx.store.writer import FileRecord, SampleWriter, seal


def open_backend(spec: RunSpec, model_dir: Path, device: str) -> TransformersBackend:
    """The run's model with its capture hooks, laid out as the spec says (packed, compiled, its
    share of a tensor-parallel group)."""
    p = spec.parallel
    return TransformersBackend.load(
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
    )


class Extractor:
    """Captures a shard's missing samples batch by batch and hands them to the writer.

    ``reserve``: bytes of free space to keep (None: no guard); the guard is the first of ``gates``,
    called before each batch is captured. ``staging``: a ring to share
    (the benchmark reuses one across variants); by default one is made for the backend's device and
    the run's codec (fp8: encoded on the device, before the copy).
    ``peers``: the other ranks of a tensor-parallel group, which compute every batch with us.
    ``forecast``: the start's space forecast (``job.space.plan_space``) for the disk guard; it is
    bound to ``progress`` here, so its ratio counts this session's files. ``log``: the fidelity
    gate's lines (a baseline set)."""

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
        self.peers = peers
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
        self.held = 0  # bytes of captured samples awaiting their verdict, not yet the writer's
        # called with a batch's raw bytes before it is captured (fidelity's ``gate`` judges it after):
        # each may stop the work (the disk guard's LowSpace) or hold it (a pause would wait here)
        self.gates: list[Callable[[int], None]] = []
        if reserve is not None:
            self.gates.append(DiskGuard(run, reserve, self.in_flight, self.forecast))
        self.sealing_waited = 0.0
        progress.waited_for_disk = self.waited_for_disk

    def in_flight(self) -> int:
        """Bytes captured and not yet on disk: the writer's queue and the batch awaiting its verdict."""
        return self.writer.inflight + self.held

    def waited_for_disk(self) -> float:
        """Seconds the forward pass stood still because writes were behind: for a staging slot, for
        room in the writer's queue, or for a shard's writes to be durable before its seal (the
        last shard's too: the run ends when its files are on disk)."""
        return self.staging.waited + self.writer.waited + self.sealing_waited

    def shard(self, scan: ShardScan) -> list[Future]:
        """Capture and submit every missing sample of one shard; returns the futures to wait on.
        A batch is submitted once the next one is captured (or the shard ends), after its verdict."""
        missing = set(scan.missing)
        futures: list[Future] = []
        staged: list[tuple[CapturedBatch, list[int], HostBatch]] = []  # captured, not yet judged
        try:
            for batch in self.plan.batches(scan.expected, self.spec.batch_tokens, self.spec.packed):
                if missing.isdisjoint(batch.ids):
                    continue
                if self.gates:
                    tokens = sum(int(self.plan.lengths[i]) for i in missing.intersection(batch.ids))
                    for gate in self.gates:
                        gate(tokens * self.spec.bytes_per_token)
                ids = list(batch.ids)
                if self.peers is not None:
                    self.peers.batch(ids)
                checks = fidelity.checks_for(self.spec.fidelity, ids, [self.plan.loss_mask(i) for i in ids])
                captured = self.backend.capture(ids, [self.plan.input_ids(i) for i in ids], checks)
                if self.peers is not None:
                    self.peers.agree(captured)
                wanted = [row for row, sid in enumerate(captured.sample_ids) if sid in missing]
                staged.append((captured, wanted, self.staging.stage(captured, wanted)))
                self.held += self._bytes(captured, wanted)
                if len(staged) > 1:
                    futures += self._submit(*staged.pop(0))
            while staged:
                futures += self._submit(*staged.pop(0))
        finally:
            for captured, wanted, host in staged:  # stopped before their verdict: never written
                host.drop()
                self.held -= self._bytes(captured, wanted)
        return futures

    def _bytes(self, captured: CapturedBatch, wanted: list[int]) -> int:
        return sum(captured.lengths[row] for row in wanted) * self.spec.bytes_per_token

    def _submit(self, captured: CapturedBatch, wanted: list[int], host: HostBatch) -> list[Future]:
        """Hand a captured batch's wanted samples to the writer, once the gate has passed its figures."""
        self.held -= self._bytes(captured, wanted)
        figures = None
        if self.gate is not None and host.figures is not None:
            host.ready()
            figures = fidelity.figures(host.figures)
            try:
                self.gate.judge(captured.sample_ids, figures)
            except BaseException:
                host.drop()
                raise
        futures = []
        for row, (aux, final) in zip(wanted, host.views, strict=True):
            sid = captured.sample_ids[row]
            sample = SampleTensors(
                sample_id=sid,
                input_ids=torch.from_numpy(self.plan.input_ids(sid).astype("int64")),
                loss_mask=torch.from_numpy(self.plan.loss_mask(sid).astype("uint8")),
                aux=aux,
                final=final,
                fidelity=None if figures is None else figures[row],
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

    def run_shards(self, todo: list[ShardScan]) -> None:
        """Every shard of ``todo``, sealing one shard behind so the device never waits on fsync."""
        pending: list[tuple[ShardScan, list[Future]]] = []
        with self.progress.live():
            for scan in todo:
                pending.append((scan, self.shard(scan)))
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
    the norm's input (the last layer's raw output)."""
    return FINAL_STATES[norm]


def run(session: Session, todo: Iterable[ShardScan]) -> None:
    """Every missing sample of ``todo``, shard by shard as verification settles them: the layout
    checked against the devices' memory before any rank loads a weight, then the model loaded
    (with the group's other ranks) and extracted through ``Extractor``."""
    s = session
    check_run(s.spec, s.model_dir, s.resources.device, s.log)
    if s.peers is not None:
        s.peers.load()
    backend = open_backend(s.spec, s.model_dir, s.resources.device)
    extractor = Extractor(
        s.run, s.spec, s.plan, backend, s.resources, s.progress, s.space.reserve, peers=s.peers,
        forecast=s.space.forecast, log=s.log,
    )  # fmt: skip
    try:
        extractor.run_shards(todo)
    finally:
        extractor.close()
