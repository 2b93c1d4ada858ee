"""The vLLM backend's side of the extraction (``extract.backends``): the job feeds vLLM the plan's
token ids as prompts, shard by shard within a window of tokens in flight (the disk guard and, with
a ``--window``, its pause before each batch is enqueued), checks that vLLM ran the plan's ids and
that each sample file its connector wrote has a sound header, judges the fidelity figures the
connector measured (``fidelity.Gate``, on the samples each engine step finished) and gives the
files that passed their own names (vLLM wrote them under their pending names: a step that fails,
or a driver killed before its verdict, leaves nothing counted), counts progress, and seals each
shard whose ids are all done. vLLM itself, its drafter and the connector are ``capture.vllm``.

Importing this module imports vLLM.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import vllm

from hsx.capture.vllm import close_llm, final_state, open_llm
from hsx.capture.vllm_connector import SAMPLE_KEY
from hsx.errors import BadFile, CaptureFailed, DiskFull, FidelityFailed
from hsx.extract.backends import Session
from hsx.extract.window import Pause, vllm_in_flight
from hsx.fidelity import Gate
from hsx.job.space import DiskGuard
from hsx.plan import Plan
from hsx.progress import Progress
from hsx.spec import RunSpec
from hsx.store import layout
from hsx.store.durable import fsync_dir, pending_name
from hsx.store.format import check
from hsx.store.scan import ShardScan
from hsx.store.writer import FileRecord, seal

__all__ = ["VllmFeed", "final_state", "run"]


class VllmFeed:
    """The prompts vLLM is fed: keeps it supplied with the missing samples, shard by shard, and
    seals shards as they finish.

    ``todo``: the scans of the shards with missing samples; ``guard`` is called with a batch's
    bytes before it is enqueued (the disk guard), then ``pause`` (a run's ``--window``: it waits
    there while its consumers have not released enough), ``window`` bounds the tokens in flight."""

    def __init__(
        self,
        run: Path,
        spec: RunSpec,
        plan: Plan,
        todo: Iterable[ShardScan],
        progress: Progress,
        guard: Callable[[int], None] | None,
        window: int,
        gate: Gate | None = None,
        pause: Callable[[int], None] | None = None,
    ):
        self.run, self.spec, self.plan, self.progress, self.guard = run, spec, plan, progress, guard
        self.gate, self.pause = gate, pause
        self.next_shard = 0  # the shard of the batch the pause is asked about
        self.window = window  # tokens enqueued and not yet finished, at most
        self.batches: deque[list[int]] = deque()
        self.left: dict[int, set[int]] = {}
        self.records: dict[int, list[FileRecord]] = {}
        for scan in todo:
            self.left[scan.shard] = set(scan.missing)
            self.records[scan.shard] = list(scan.good.values())
            for b in plan.batches(scan.missing, spec.batch_tokens, packed=True):
                self.batches.append(list(b.ids))
        self.requests: set[int] = set()  # sample ids enqueued and not finished
        self.inflight = 0  # tokens

    def inflight_bytes(self) -> int:
        """Bytes of the samples enqueued and not yet finished: the disk guard counts them as used."""
        return self.inflight * self.spec.bytes_per_token

    def feed(self, llm: vllm.LLM) -> None:
        """Enqueue batches until the window of tokens in flight is full."""
        from vllm import SamplingParams

        while self.batches and (self.inflight == 0 or self.inflight < self.window):
            ids = self.batches.popleft()
            tokens = int(sum(int(self.plan.lengths[i]) for i in ids))
            if self.guard is not None:
                self.guard(tokens * self.spec.bytes_per_token)
            if self.pause is not None:
                self.next_shard = layout.shard_of(ids[0], self.spec.shard_size)
                self.pause(tokens * self.spec.bytes_per_token)
            prompts = [{"prompt_token_ids": self.plan.input_ids(i).tolist()} for i in ids]
            params = [
                SamplingParams(
                    max_tokens=1, temperature=0.0, detokenize=False, extra_args={"kv_transfer_params": {SAMPLE_KEY: i}}
                )
                for i in ids
            ]
            llm.enqueue(prompts, params, use_tqdm=False)
            self.requests.update(ids)
            self.inflight += tokens

    def finished(self, out: vllm.RequestOutput) -> FileRecord:
        """One request's output: its sample id comes back from the connector on kv_transfer_params;
        its file's record, once vLLM ran the plan's ids and the file's header is sound."""
        sid = int((out.kv_transfer_params or {}).get(SAMPLE_KEY, -1))
        if sid not in self.requests:
            raise CaptureFailed(f"vLLM finished request {out.request_id} that carries no sample id of this run")
        self.requests.discard(sid)
        token_ids = out.prompt_token_ids
        want = self.plan.input_ids(sid)
        n = len(want)
        self.inflight -= n
        if token_ids is None or not np.array_equal(np.asarray(token_ids, dtype=np.int64), want):
            raise CaptureFailed(
                f"sample {sid}: vLLM ran {len(token_ids or [])} token ids that are not the plan's {n}; "
                "nothing was written for it"
            )
        path = self._written(sid)
        try:
            header = check(path, sid, deep=False)
        except (BadFile, OSError) as e:
            need = 2 * n * self.spec.bytes_per_token
            if shutil.disk_usage(self.run).free < need:
                raise DiskFull(path) from e
            raise CaptureFailed(
                f"sample {sid}: vLLM finished it but its file is not there ({e}); see vLLM's log"
            ) from e
        if self.gate is not None and header.fidelity is None:
            raise CaptureFailed(f"sample {sid}: its file carries no fidelity figure, which this run checks")
        return FileRecord(sid, path.stat().st_size, header.digest, fidelity=header.fidelity)

    def _written(self, sid: int) -> Path:
        """Where the connector wrote the sample: its pending name where the run checks fidelity."""
        path = layout.sample_path(self.run, sid, self.spec.shard_size)
        return path if self.gate is None else pending_name(path)

    def judged(self, records: list[FileRecord]) -> None:
        """The samples one engine step finished: their figures judged together, the files that
        passed given their own names (a step that fails has its files removed, then stops the
        run), then counted, and their shards sealed once whole."""
        if self.gate is not None and records:
            try:
                self.gate.judge([r.sample_id for r in records], [r.fidelity for r in records])
            except FidelityFailed:
                for r in records:
                    self._written(r.sample_id).unlink(missing_ok=True)
                raise
            for r in records:
                path = layout.sample_path(self.run, r.sample_id, self.spec.shard_size)
                os.rename(pending_name(path), path)
            for shard in sorted({layout.shard_of(r.sample_id, self.spec.shard_size) for r in records}):
                fsync_dir(layout.shard_dir(self.run, shard))
        for record in records:
            done: Future = Future()
            done.set_result(record)
            self.progress.on_written(int(self.plan.lengths[record.sample_id]))(done)
            shard = layout.shard_of(record.sample_id, self.spec.shard_size)
            self.records[shard].append(record)
            self.left[shard].discard(record.sample_id)
            if not self.left[shard]:  # every id of the shard has a durable, checked file
                seal(self.run, shard, self.records.pop(shard))
                del self.left[shard]

    def run_engine(self, llm: vllm.LLM) -> None:
        """Step the engine until every sample is back; refuse when vLLM dropped any."""
        engine = llm.llm_engine
        while True:
            self.feed(llm)
            if not engine.has_unfinished_requests():
                break
            self.judged([self.finished(out) for out in engine.step() if out.finished])
        if self.left:
            raise CaptureFailed(f"shards {sorted(self.left)} still have samples vLLM never returned")


def run(session: Session, todo: Iterable[ShardScan]) -> None:
    """The vLLM counterpart of ``extract.pipeline.run``: capture every missing sample of ``todo``
    (scans already settled by ``job.resume``), keeping the start's reserve free, the bytes in
    flight scaled by the codec's ratio (the start's forecast, bound here to this session's files)."""
    s = session
    window = vllm_in_flight(s.spec.batch_tokens, int(s.plan.lengths.max()))
    gate = None if s.spec.fidelity is None else Gate(s.run, s.spec.fidelity, s.log)
    if gate is not None:
        s.progress.fidelity = gate.metrics
    feed = VllmFeed(s.run, s.spec, s.plan, todo, s.progress, None, window=window, gate=gate)
    if s.spec.window is not None:  # the enqueued requests are captured and not written: a wait on one goes on
        feed.pause = Pause(s.run, s.spec.window, s.spec.shard_size, s.log, lambda: (feed.next_shard, feed.requests))
    forecast = s.space.forecast
    forecast.session = s.progress.session
    feed.guard = DiskGuard(s.run, s.space.reserve, in_flight=feed.inflight_bytes, forecast=forecast)
    llm = open_llm(s.run, s.model_dir, s.spec, int(s.plan.lengths.max()), s.tensor_parallel_size, s.data_parallel_size)
    try:
        with s.progress.live():
            feed.run_engine(llm)
    finally:
        close_llm(llm)
