"""Device-to-host hand-off between capture and store, overlapped with the next forward pass.

On CUDA: a ring of reused pinned host buffers. Each batch's real tokens (never padding) are copied
into a free slot on a side stream, the copy is fenced by an event, and the samples are handed to
the writer at once; a writer thread waits on the event before hashing, and the slot returns to
the ring when its last sample is written. The compute stream never waits for the disk unless
every slot is still being written (backpressure, bounded host memory).
On CPU: the captured tensors already live in host memory; samples are views of them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from hsx.capture import CapturedBatch


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
    """Host views of one batch's samples plus a readiness fence and a release hook."""

    def __init__(
        self, views: list[tuple[torch.Tensor, torch.Tensor]], ready: Callable[[], None], release: Callable[[], None]
    ):
        self.views, self.ready = views, ready
        self._left = len(views)
        self._lock = threading.Lock()
        self._release = release

    def done_one(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._release()


class CpuStaging:
    waited = 0.0  # the captured tensors are the host buffers: nothing to wait for

    def stage(self, batch: CapturedBatch, wanted: list[int]) -> HostBatch:
        views = [batch.sample(i) for i in wanted]
        return HostBatch(views, lambda: None, lambda: None)

    def close(self) -> None:
        pass


class CudaStaging:
    def __init__(
        self, device: torch.device, dtype: torch.dtype, width: int, hidden: int, slot_tokens: int, slots: int = 3
    ):
        """``width`` = L*H (aux), ``hidden`` = H; each slot holds ``slot_tokens`` tokens of both."""
        self.device, self.width, self.hidden = device, width, hidden
        self.stream = torch.cuda.Stream(device)
        self.free: queue.Queue = queue.Queue()
        self.slot_tokens = slot_tokens
        self.waited = 0.0  # seconds the compute side blocked for a free slot (the disk was behind)
        for _ in range(slots):
            aux = torch.empty((slot_tokens, width), dtype=dtype, pin_memory=True)
            final = torch.empty((slot_tokens, hidden), dtype=dtype, pin_memory=True)
            self.free.put((aux, final))

    def stage(self, batch: CapturedBatch, wanted: list[int]) -> HostBatch:
        total = sum(batch.lengths[i] for i in wanted)
        if total > self.slot_tokens:
            raise ValueError(f"batch of {total} tokens exceeds the staging slot of {self.slot_tokens}")
        t0 = time.perf_counter()
        aux_h, final_h = self.free.get()  # blocks when every slot is still being written
        self.waited += time.perf_counter() - t0
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        views, off = [], 0
        with torch.cuda.stream(self.stream):
            for row, start, n in _runs(batch, wanted):  # packed samples are one contiguous run: one copy
                aux_h[off : off + n].copy_(batch.aux[row, start : start + n], non_blocking=True)
                final_h[off : off + n].copy_(batch.final[row, start : start + n], non_blocking=True)
                off += n
            off = 0
            for i in wanted:
                n = batch.lengths[i]
                views.append((aux_h[off : off + n], final_h[off : off + n]))
                off += n
            event = torch.cuda.Event()
            event.record(self.stream)
        batch.aux.record_stream(self.stream)  # keep device memory alive until the copy is done
        batch.final.record_stream(self.stream)
        return HostBatch(views, event.synchronize, lambda: self.free.put((aux_h, final_h)))

    def close(self) -> None:
        self.stream.synchronize()


Staging = CpuStaging | CudaStaging


def staging_for(
    device: torch.device, dtype: torch.dtype, width: int, hidden: int, slot_tokens: int, budget_bytes: int
) -> Staging:
    """Pinned slots on CUDA, as many as ``budget_bytes`` holds (2..16): spare slots absorb the disk's
    bursts so that the forward pass does not wait on a slow fsync."""
    if device.type == "cuda":
        slot_bytes = slot_tokens * (width + hidden) * torch.empty((), dtype=dtype).element_size()
        return CudaStaging(device, dtype, width, hidden, slot_tokens, max(2, min(16, budget_bytes // slot_bytes)))
    return CpuStaging()
