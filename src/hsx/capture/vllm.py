"""Capture with vLLM: its ``extract_hidden_states`` speculative method plus hsx's KV connector.

For targets too large for transformers (multi-GPU MoE under tensor / data parallelism). The driver
(this module) runs ``vllm.LLM`` in-process and feeds it the plan's token ids as prompts with
``max_tokens=1``; vLLM schedules them (continuous batching, chunked prefill, prefix caching) and
its drafter copies the chosen layers' states into a cache-only KV layer; hsx's connector
(``vllm_connector``) writes each finished prompt's sample file through the store from inside
vLLM's worker. The driver then checks vLLM's token ids against the plan's, verifies each new
file's header, reports progress and seals every shard whose ids are all done.

Layers: vLLM's aux id j is the residual stream after layer j-1 (transformers
``hidden_states[j]``), so hsx layer k is vLLM id k+1; vLLM id N is the last layer's output
BEFORE the final norm, which the connector turns into ``hidden_states`` by applying the
checkpoint's own final RMSNorm (weight and eps read from the checkpoint), exactly as
transformers computes it. The spec's ``final_state`` records this.

Importing this module imports vLLM (that is the check that the backend is available) and
starts nothing.
"""

from __future__ import annotations

import shutil
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import vllm

from hsx.capture import check_layers
from hsx.capture.vllm_connector import CONNECTOR, EXTRA_KEY, SAMPLE_KEY, SinkConfig
from hsx.errors import BadFile, CaptureFailed, DiskFull
from hsx.finalnorm import FinalNorm, locate
from hsx.job.space import DiskGuard, Forecast
from hsx.plan import Plan, batches_for
from hsx.progress import Progress
from hsx.spec import RunSpec
from hsx.store import layout
from hsx.store.format import FINAL_STATE, check
from hsx.store.scan import ShardScan
from hsx.store.writer import FileRecord, seal
from hsx.target import load_config

__version__ = vllm.__version__


def vllm_ids(layers: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """The vLLM aux ids to capture (ascending: vLLM returns them sorted whatever order it is
    given), the row of each hsx layer among them (in the spec's order), and the row of id N."""
    check_layers(layers, num_layers)
    ids = sorted({k + 1 for k in layers} | {num_layers})
    return ids, [ids.index(k + 1) for k in layers], ids.index(num_layers)


def final_norm(model_dir: Path) -> FinalNorm:
    """The checkpoint's final norm (``hsx.finalnorm.locate``), refused for (1 + weight) norms: the
    connector would apply them as transformers does, but no vLLM model of those families has been
    compared with the transformers backend."""
    norm = locate(model_dir)
    if norm.offset:
        model_type = load_config(model_dir).get("model_type", "")
        raise CaptureFailed(f"the vLLM backend does not handle {model_type}'s (1 + weight) final norm")
    return norm


def final_state(model_dir: Path) -> str:
    """What the run spec records as its final state for this backend."""
    norm = final_norm(model_dir)
    return (
        f"{FINAL_STATE} (vLLM backend: vLLM aux id N, the last layer's output before the norm, "
        f"then the checkpoint's RMSNorm {norm.tensor}, eps {norm.eps}, float32 statistics as transformers)"
    )


def open_llm(
    run: Path,
    model_dir: Path,
    spec: RunSpec,
    longest: int,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
) -> vllm.LLM:
    """vLLM with the extract_hidden_states drafter and hsx's connector writing into ``run``.

    ``longest``: the plan's longest sample in tokens (sets vLLM's context length). Nothing is
    written until prompts are enqueued (``Feeder``)."""
    from vllm.platforms import current_platform

    ids, aux_rows, final_row = vllm_ids(spec.layers, spec.model.num_layers)
    sink = SinkConfig(
        run.resolve(), spec.shard_size, spec.layers, aux_rows, final_row, final_norm(model_dir), spec.codec.value
    )
    return vllm.LLM(
        model=str(model_dir),
        dtype=spec.dtype,
        trust_remote_code=spec.trust_remote_code,
        tensor_parallel_size=tensor_parallel_size,
        **({"data_parallel_size": data_parallel_size} if data_parallel_size > 1 else {}),  # vLLM decides
        max_model_len=longest + 2,  # the prompt, the one sampled token, the drafter's slot
        max_num_batched_tokens=spec.batch_tokens,
        enforce_eager=current_platform.is_cpu(),
        seed=0,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": "hsx.capture.vllm_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {EXTRA_KEY: sink.to_dict()},
        },
    )


def close_llm(llm: vllm.LLM) -> None:
    """Stop vLLM's engine processes now rather than at interpreter exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # already gone, or an engine without a separate core
        pass


class Feeder:
    """Keeps vLLM supplied with the missing samples, shard by shard, and seals shards as they finish.

    ``todo``: the scans of the shards with missing samples; ``guard`` is called with a batch's
    bytes before it is enqueued (the disk guard), ``window`` bounds the tokens in flight."""

    def __init__(
        self,
        run: Path,
        spec: RunSpec,
        plan: Plan,
        todo: Iterable[ShardScan],
        progress: Progress,
        guard: Callable[[int], None] | None,
        window: int,
    ):
        self.run, self.spec, self.plan, self.progress, self.guard = run, spec, plan, progress, guard
        self.window = window  # tokens enqueued and not yet finished, at most
        self.batches: deque[list[int]] = deque()
        self.left: dict[int, set[int]] = {}
        self.records: dict[int, list[FileRecord]] = {}
        for scan in todo:
            self.left[scan.shard] = set(scan.missing)
            self.records[scan.shard] = list(scan.good.values())
            for b in batches_for(scan.missing, plan.lengths, spec.batch_tokens, packed=True):
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

    def finished(self, out: vllm.RequestOutput) -> None:
        """One request's output: its sample id comes back from the connector on kv_transfer_params."""
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
        path = layout.sample_path(self.run, sid, self.spec.shard_size)
        try:
            header = check(path, sid, deep=False)
        except (BadFile, OSError) as e:
            need = 2 * n * self.spec.bytes_per_token
            if shutil.disk_usage(self.run).free < need:
                raise DiskFull(path) from e
            raise CaptureFailed(
                f"sample {sid}: vLLM finished it but its file is not there ({e}); see vLLM's log"
            ) from e
        record = FileRecord(sid, path.stat().st_size, header.digest)
        done: Future = Future()
        done.set_result(record)
        self.progress.on_written(n)(done)
        shard = layout.shard_of(sid, self.spec.shard_size)
        self.records[shard].append(record)
        self.left[shard].discard(sid)
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
            for out in engine.step():
                if out.finished:
                    self.finished(out)
        if self.left:
            raise CaptureFailed(f"shards {sorted(self.left)} still have samples vLLM never returned")


def run_shards_vllm(
    run: Path,
    spec: RunSpec,
    plan: Plan,
    model_dir: Path,
    todo: list[ShardScan],
    progress: Progress,
    reserve: int | None = None,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    forecast: Forecast | None = None,
) -> None:
    """The vLLM counterpart of ``extract.pipeline.Extractor.run_shards``: capture every missing sample
    of ``todo`` (scans already settled by ``job.resume``), keeping ``reserve`` bytes free, the
    bytes in flight scaled by the codec's ratio (``forecast``, bound here to this session's files)."""
    window = max(4 * spec.batch_tokens, int(plan.lengths.max()))
    feeder = Feeder(run, spec, plan, todo, progress, None, window=window)
    if reserve is not None:
        forecast = forecast or Forecast(spec)
        forecast.session = progress.session
        feeder.guard = DiskGuard(run, reserve, in_flight=feeder.inflight_bytes, forecast=forecast)
    llm = open_llm(run, model_dir, spec, int(plan.lengths.max()), tensor_parallel_size, data_parallel_size)
    try:
        with progress.live():
            feeder.run_engine(llm)
    finally:
        close_llm(llm)
