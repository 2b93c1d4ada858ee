"""hsx's KV connector for vLLM: each request's captured states go straight into the run's store.

vLLM loads this class by name (``kv_connector_module_path``) inside its own processes: the
scheduler (EngineCore) and every worker. With the ``extract_hidden_states`` speculative method,
the chosen layers' states of every computed token land in a cache-only KV layer,
``[num_blocks, n_ids, block_size, hidden]``, one "head" per vLLM aux id (in ascending id order).

Flow, per request (one plan sample):
- scheduler: the driver tags the request with its sample id (``kv_transfer_params``). When the
  step that computes the prompt's last token is scheduled, the connector sends the worker
  (sample id, the token ids vLLM runs, the request's block ids) in the step's metadata.
- worker: after that step's drafter has filled the cache (``wait_for_save``), tensor-parallel
  rank 0 gathers the rows, checks vLLM's token ids against the plan's, maps vLLM ids to hsx
  layers, applies the checkpoint's final norm (``hsx.finalnorm``, as transformers computes it),
  and writes the sample file through the store (temp file, fsync, rename); the folders are
  fsynced before the step returns, so a file is durable before the driver hears the request
  finished. Nothing is staged outside the run. Where the run checks fidelity, the file is
  written under its pending name (``store.durable.pending_name``: a temp file to every reader),
  and the driver gives it its own name once the gate passed its figure.
A sample that cannot be written (token mismatch, full disk) is logged and left without a file;
the driver sees the missing file and stops. Imports stay light: this runs in every vLLM process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from hsx.finalnorm import FinalNorm

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CONNECTOR = "HsxConnector"
EXTRA_KEY = "hsx"  # kv_connector_extra_config[EXTRA_KEY]: SinkConfig.to_dict()
SAMPLE_KEY = "hsx_sample_id"  # a request's kv_transfer_params[SAMPLE_KEY]: its plan sample id
STATE_LAYER = "cache_only_layers"  # name part of the cache-only layer that holds the states

log = logging.getLogger("hsx.vllm")


@dataclass
class Prompt:
    """One request whose prompt completes in this step."""

    sample_id: int
    token_ids: list[int]  # what vLLM actually runs, checked against the plan on the worker
    block_ids: list[int]  # of the state cache's group


@dataclass
class Metadata(KVConnectorMetadata):
    prompts: list[Prompt] = field(default_factory=list)


@dataclass(frozen=True)
class SinkConfig:
    """What the worker needs to write the run's files. vLLM carries it to its processes inside
    ``kv_connector_extra_config``, which must stay plain JSON: hence ``to_dict``/``from_dict``."""

    run: Path
    shard_size: int
    layers: list[int]  # hsx layer ids, in the spec's order
    aux_rows: list[int]  # state-cache head of each of ``layers``
    final_row: int  # head holding vLLM id N, the last layer's output before the norm
    norm: FinalNorm  # applied to that head to give ``hidden_states``
    codec: str = "raw"  # the run's storage codec (hsx.store.codec), by name
    fidelity_stride: int = 0  # the run's --fidelity-stride (0: it checks no fidelity)
    model_dir: Path | None = None  # the checkpoint whose LM head the fidelity check reads

    def to_dict(self) -> dict[str, Any]:
        n = self.norm
        return {
            "run": str(self.run),
            "shard_size": self.shard_size,
            "layers": list(self.layers),
            "aux_rows": list(self.aux_rows),
            "final_row": self.final_row,
            "norm": {"file": str(n.file), "tensor": n.tensor, "eps": n.eps, "offset": n.offset, "divisor": n.divisor},
            "codec": self.codec,
            "fidelity_stride": self.fidelity_stride,
            "model_dir": None if self.model_dir is None else str(self.model_dir),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SinkConfig:
        norm = d["norm"]
        return cls(
            run=Path(d["run"]),
            shard_size=int(d["shard_size"]),
            layers=[int(k) for k in d["layers"]],
            aux_rows=[int(r) for r in d["aux_rows"]],
            final_row=int(d["final_row"]),
            norm=FinalNorm(
                Path(norm["file"]), norm["tensor"], float(norm["eps"]), bool(norm["offset"]), norm.get("divisor", 1.0)
            ),
            codec=str(d.get("codec", "raw")),
            fidelity_stride=int(d.get("fidelity_stride", 0)),
            model_dir=None if d.get("model_dir") is None else Path(d["model_dir"]),
        )


class Sink:
    """Turns a request's rows of the state cache into a verified sample file of the run, with its
    fidelity figure where the run checks it: the checkpoint's LM head (``head``, on the cache's
    device, in its dtype) on the final state as stored, at the positions ``hsx.fidelity.positions``
    picks, as the transformers backend measures it. The driver judges the figures (``extract.vllm``)."""

    def __init__(self, cfg: SinkConfig, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.cfg = cfg
        _ = cfg.norm.weight  # read at start, so a weight file that cannot be read fails here, not mid-run
        self._plan = None
        self.head = None
        if cfg.fidelity_stride:
            from hsx.fidelity import Head

            self.head = Head.of_checkpoint(cfg.model_dir, device or "cpu", dtype or torch.float32)

    @property
    def plan(self):
        if self._plan is None:  # loaded on first use, only in the process that writes
            from hsx.plan import Plan
            from hsx.spec import load_spec

            self._plan = Plan(self.cfg.run, load_spec(self.cfg.run).plan.parts)
        return self._plan

    def write(self, prompts: list[Prompt], cache: torch.Tensor, block_size: int) -> None:
        from hsx.store import layout
        from hsx.store.durable import DiskFull, fsync_dir, pending_name, write_parts
        from hsx.store.format import SampleTensors, encode

        touched: set[Path] = set()
        for p in prompts:
            want = self.plan.input_ids(p.sample_id)
            if not np.array_equal(np.asarray(p.token_ids, dtype=np.int64), want):
                log.error(
                    "hsx: sample %d: vLLM ran %d token ids that differ from the plan's %d; not written",
                    p.sample_id,
                    len(p.token_ids),
                    len(want),
                )
                continue
            n, mask = len(want), self.plan.loss_mask(p.sample_id)
            blocks = torch.tensor(p.block_ids, dtype=torch.long, device=cache.device)
            slots = (blocks[:, None] * block_size + torch.arange(block_size, device=cache.device)).flatten()[:n]
            rows = cache[slots // block_size, :, slots % block_size]  # [n, n_ids, H], on the device
            final = self.cfg.norm.apply(rows[:, self.cfg.final_row])  # the state stored, which is checked
            sample = SampleTensors(
                sample_id=p.sample_id,
                input_ids=torch.from_numpy(want.astype("int64")),
                loss_mask=torch.from_numpy(mask.astype("uint8")),
                aux=rows[:, self.cfg.aux_rows].reshape(n, -1).to("cpu").contiguous(),
                final=final.to("cpu").contiguous(),
                fidelity=self._figure(p.sample_id, want, mask, final),
            )
            path = layout.sample_path(self.cfg.run, p.sample_id, self.cfg.shard_size)
            if self.head is not None:  # the driver names it once the gate has passed its figure
                path = pending_name(path)
            parts, _ = encode(sample, self.cfg.layers, self.cfg.codec)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                write_parts(path, parts, sync_dir=False)
            except DiskFull as e:
                log.error("hsx: sample %d not written: %s", p.sample_id, e)
                continue
            touched.add(path.parent)
        for folder in sorted(touched):  # one fsync per folder per step: the renames are durable
            fsync_dir(folder)

    def _figure(self, sample_id: int, ids: np.ndarray, mask: np.ndarray, final: torch.Tensor):
        """The sample's fidelity figure (None where the run checks none), measured on the device on
        the final state as stored (after the norm)."""
        if self.head is None:
            return None
        from hsx.fidelity import figures, measure, positions

        checks = [positions(sample_id, mask, self.cfg.fidelity_stride)]
        return figures(measure(self.head, final[None], [0], [0], [ids], checks).cpu())[0]


class HsxConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler side: tells the worker which prompts complete this step. Worker side: writes them."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config(EXTRA_KEY, None)
        if not extra:
            raise ValueError(f"{CONNECTOR} needs kv_connector_extra_config[{EXTRA_KEY!r}]")
        self.cfg = SinkConfig.from_dict(extra)
        self.block_size = vllm_config.cache_config.block_size
        self.group = 0
        if kv_cache_config is not None:
            groups = kv_cache_config.kv_cache_groups
            found = [i for i, g in enumerate(groups) if any(STATE_LAYER in n for n in g.layer_names)]
            if len(found) != 1:
                raise RuntimeError(f"{CONNECTOR}: expected one KV cache group holding {STATE_LAYER}, found {found}")
            self.group = found[0]
            self.block_size = groups[self.group].kv_cache_spec.block_size
        # scheduler side
        self.waiting: dict[str, Request] = {}
        self.ready: list[Prompt] = []
        self.kv_manager = None
        # worker side
        self.cache: torch.Tensor | None = None
        self.sink: Sink | None = None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        names = [n for n in kv_caches if STATE_LAYER in n]
        if len(names) != 1:
            raise RuntimeError(f"{CONNECTOR}: expected one {STATE_LAYER} cache, found {names}")
        self.cache = kv_caches[names[0]]
        if self.cache.shape[2] != self.block_size:
            raise RuntimeError(f"{CONNECTOR}: state cache block size {self.cache.shape[2]} != {self.block_size}")
        # The states are replicated across tensor-parallel ranks: rank 0 writes.
        if get_tensor_model_parallel_rank() == 0:
            self.sink = Sink(self.cfg, self.cache.device, self.cache.dtype)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the cache-only layer writes the states into the cache itself

    def wait_for_save(self) -> None:
        """Runs after this step's drafter filled the state cache: write the prompts that completed."""
        if self.sink is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, Metadata) and meta.prompts:
            self.sink.write(meta.prompts, self.cache, self.block_size)

    # ------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.kv_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if SAMPLE_KEY in params and request.prompt_token_ids is not None:
            self.waiting[request.request_id] = request  # new, or resumed after a preemption

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self.waiting.get(rid)
            if req is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # not scheduled now, or its prompt completes in a later step
            del self.waiting[rid]
            blocks = self.kv_manager.get_block_ids(rid)[self.group]
            sid = int(req.kv_transfer_params[SAMPLE_KEY])
            self.ready.append(Prompt(sid, list(req.prompt_token_ids), list(blocks)))
        meta, self.ready = Metadata(prompts=self.ready), []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once (the states were written in the prompt's last step); the
        sample id goes back to the driver on the request's output."""
        self.waiting.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        return False, ({SAMPLE_KEY: params[SAMPLE_KEY]} if SAMPLE_KEY in params else None)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None
