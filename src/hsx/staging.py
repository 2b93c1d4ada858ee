"""Device-to-host hand-off between capture and store, overlapped with the next forward pass.

On CUDA: a ring of reused pinned host buffers. Each batch's real tokens (never padding) are copied
into a free slot on a side stream, the copy is fenced by an event, and the samples are handed to
the writer at once; a writer thread waits on the event before hashing, and the slot returns to
the ring when its last sample is written. The compute stream never waits for the disk unless
every slot is still being written (backpressure, bounded host memory).
On CPU: the captured tensors already live in host memory; samples are views of them.
A batch's fidelity figures (``CapturedBatch.fidelity``) and tap figures (``taps``), where measured,
and its teacher rows (``CapturedBatch.teacher``), where the run stores them, come over with its
states, behind the same fence (the rows in pinned buffers of their own: they are small next to the
states).

With the fp8 codec the ring carries encoded states: each batch is quantized on the device, on the
side stream, before its copy (``codec.encode_early``), so the copy and the pinned slots hold half the
bytes and the writer stores the payload as it is. zstd is encoded on the host, by the writer.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable

import torch

from hsx.capture import CapturedBatch
from hsx.store.codec import Codec, Encoded, encode_early
from hsx.teacher import Rows

State = torch.Tensor | Encoded  # one sample's state as the writer receives it
Slot = list[list[torch.Tensor]]  # per state (aux, final): its host buffers


def _runs(batch: CapturedBatch, wanted: list[int]) -> list[tuple[int, int, int]]:
    """(row, start, length) copies covering the wanted samples, merged where they are adjacent."""
    runs: list[list[int]] = []
    for i in wanted:
        row, start, n = batch.rows[i], batch.offsets[i], batch.lengths[i]
        if runs and runs[-1][0] == row and runs[-1][1] + runs[-1][2] == start:
            runs[-1][2] += n
        else:
            runs.append([row, start, n])
    return [(r, s, n) for r, s, n in runs]


class HostBatch:
    """Host views of one batch's samples plus a readiness fence and a release hook; ``figures``
    and ``taps``: the batch's fidelity and tap figures on the host (valid once ``ready`` returns),
    where measured; ``teacher``: each wanted sample's teacher rows on the host (valid as
    ``figures``), where stored."""

    def __init__(
        self,
        views: list[tuple[State, State]],
        ready: Callable[[], None],
        release: Callable[[], None],
        figures: torch.Tensor | None = None,
        teacher: list[dict[str, torch.Tensor]] | None = None,
        taps: torch.Tensor | None = None,
    ):
        self.views, self.ready, self.figures, self.teacher, self.taps = views, ready, figures, teacher, taps
        self._left = len(views)
        self._lock = threading.Lock()
        self._release = release

    def drop(self) -> None:
        """None of its samples will be written: its buffers go back now."""
        self.ready()
        with self._lock:
            left, self._left = self._left, 0
        if left:
            self._release()

    def done_one(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._release()


class SlotLayout:
    """What a staging slot holds, and how a batch's samples are put in it: each state as captured,
    or, for fp8, its payload and scales encoded where it was captured. ``codec`` is the run's; only
    fp8 is encoded before the copy (zstd is the writer's, on the host)."""

    def __init__(self, codec: Codec, dtype: torch.dtype, width: int, hidden: int):
        self.encodes = Codec.FP8 if Codec(codec) is Codec.FP8 else Codec.RAW
        self.dtype = dtype
        self.states = ((width, width // hidden), (hidden, 1))  # (columns, layers) of aux and final

    def _buffers(self, tokens: int) -> list[list[tuple[tuple[int, int], torch.dtype]]]:
        if self.encodes is Codec.FP8:
            return [[((tokens, c), torch.float8_e4m3fn), ((tokens, g), torch.float32)] for c, g in self.states]
        return [[((tokens, c), self.dtype)] for c, _ in self.states]

    def slot(self, tokens: int, pin: bool) -> Slot:
        """Host buffers for ``tokens`` tokens of every state."""
        return [[torch.empty(shape, dtype=dt, pin_memory=pin) for shape, dt in s] for s in self._buffers(tokens)]

    def nbytes(self, tokens: int) -> int:
        return sum(math.prod(shape) * dt.itemsize for s in self._buffers(tokens) for shape, dt in s)

    def fill(self, slot: Slot, batch: CapturedBatch, wanted: list[int]) -> list[tuple[State, State]]:
        """Copy the wanted samples' states into ``slot`` (non-blocking: the caller fences the copies),
        encoding them first where they lie; returns each sample's (aux, final) as held in the slot."""
        off = 0
        for row, start, n in _runs(batch, wanted):  # packed samples are one contiguous run: one copy
            for bufs, src, (cols, groups) in zip(slot, (batch.aux, batch.final), self.states, strict=True):
                if not cols:  # a run without taps: no aux state to copy
                    continue
                part = src[row, start : start + n]
                parts = encode_early(self.encodes, part, groups).tensors if self.encodes is Codec.FP8 else (part,)
                for buf, p in zip(bufs, parts, strict=True):
                    buf[off : off + n].copy_(p, non_blocking=True)
            off += n
        views, off = [], 0
        for i in wanted:
            n = batch.lengths[i]
            aux, final = (self._view(bufs, off, n, cols) for bufs, (cols, _) in zip(slot, self.states, strict=True))
            views.append((aux, final))
            off += n
        return views

    def _view(self, bufs: list[torch.Tensor], off: int, n: int, cols: int) -> State:
        if self.encodes is Codec.FP8:
            return Encoded(Codec.FP8, self.dtype, (n, cols), tuple(b[off : off + n] for b in bufs))
        return bufs[0][off : off + n]


class CpuStaging:
    waited = 0.0  # the captured tensors are the host buffers: nothing to wait for
    encodes = Codec.RAW  # the writer encodes every codec, on the host

    def stage(self, batch: CapturedBatch, wanted: list[int]) -> HostBatch:
        views = [batch.sample(i) for i in wanted]
        teacher = None if batch.teacher is None else [batch.teacher.sample(i) for i in wanted]
        return HostBatch(views, lambda: None, lambda: None, batch.fidelity, teacher, batch.taps)

    def close(self) -> None:
        pass


class CudaStaging:
    def __init__(self, device: torch.device, layout: SlotLayout, slot_tokens: int, slots: int = 3):
        """Each of ``slots`` slots holds ``slot_tokens`` tokens of every state, as ``layout`` says."""
        self.device, self.layout = device, layout
        self.encodes = layout.encodes
        self.stream = torch.cuda.Stream(device)
        self.free: queue.Queue = queue.Queue()
        self.slot_tokens = slot_tokens
        self.waited = 0.0  # seconds the compute side blocked for a free slot (the disk was behind)
        for _ in range(slots):
            self.free.put(layout.slot(slot_tokens, pin=True))

    def stage(self, batch: CapturedBatch, wanted: list[int]) -> HostBatch:
        total = sum(batch.lengths[i] for i in wanted)
        if total > self.slot_tokens:
            raise ValueError(f"batch of {total} tokens exceeds the staging slot of {self.slot_tokens}")
        t0 = time.perf_counter()
        slot = self.free.get()  # blocks when every slot is still being written
        self.waited += time.perf_counter() - t0
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):  # any encoding's scratch is allocated on this stream too
            views = self.layout.fill(slot, batch, wanted)
            figures, taps = (self._to_host(t) for t in (batch.fidelity, batch.taps))
            teacher = None if batch.teacher is None else self._teacher(batch.teacher, wanted)
            event = torch.cuda.Event()
            event.record(self.stream)
        batch.aux.record_stream(self.stream)  # keep device memory alive until the copy is done
        batch.final.record_stream(self.stream)
        return HostBatch(views, event.synchronize, lambda: self.free.put(slot), figures, teacher, taps)

    def _teacher(self, rows: Rows, wanted: list[int]) -> list[dict[str, torch.Tensor]]:
        """The batch's teacher rows copied to pinned host buffers on the side stream: each wanted
        sample's, as views of them."""
        host = {}
        for name, t in rows.tensors.items():
            host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host[name].copy_(t, non_blocking=True)
            t.record_stream(self.stream)
        return [Rows(host, rows.counts).sample(i) for i in wanted]

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A batch's figures copied to pinned memory on the side stream (behind the batch's fence)."""
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)
        return host

    def close(self) -> None:
        self.stream.synchronize()


Staging = CpuStaging | CudaStaging


def staging_for(
    device: torch.device,
    dtype: torch.dtype,
    width: int,
    hidden: int,
    slot_tokens: int,
    budget_bytes: int,
    codec: Codec = Codec.RAW,
) -> Staging:
    """Pinned slots on CUDA, as many as ``budget_bytes`` holds (2..16): spare slots absorb the disk's
    bursts so that the forward pass does not wait on a slow fsync. ``width`` = L*H (aux), ``hidden`` = H;
    with ``codec`` fp8 the slots hold the states encoded on the device."""
    if device.type == "cuda":
        layout = SlotLayout(codec, dtype, width, hidden)
        slots = max(2, min(16, budget_bytes // layout.nbytes(slot_tokens)))
        return CudaStaging(device, layout, slot_tokens, slots)
    return CpuStaging()
