"""What the operator asked for, parsed once: ``ExtractOptions``, their defaults, the auto|on|off toggles.

Options live at the top of the job; stages below it get resolved values (``Resources``, a model
folder, a device), never the whole ``ExtractOptions``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from hsx.errors import OptionError
from hsx.spec import Parallel
from hsx.telemetry import Telemetry

Toggle = Literal["auto", "on", "off"]
Backend = Literal["transformers", "vllm"]
DEFAULTS = {"max_length": 4096, "batch_tokens": 16384, "shard_size": 1000, "dtype": "auto", "codec": "raw"}


def toggle(flag: str, value: str) -> Toggle:
    """``--flag auto|on|off``, or a refusal naming the flag."""
    if value not in get_args(Toggle):
        raise OptionError(f"--{flag} takes auto, on or off, not {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class Resources:
    """What one extracting process may use: its device, writer threads, host memory for writes."""

    device: str
    writers: int = 8
    max_inflight_bytes: int = 4 << 30  # host memory for states not yet on disk (pinned staging on CUDA)


@dataclass
class ExtractOptions:
    out: Path
    model: str | None = None
    data: list[Path] = field(default_factory=list)
    layers: list[int] | None = None
    max_length: int | None = None
    batch_tokens: int | None = None
    dtype: str | None = None
    device: str | None = None
    shard_size: int | None = None
    trust_remote_code: bool = False
    writers: int = 8
    max_inflight_bytes: int = 4 << 30
    deep_verify: bool = True
    packing: Toggle = "auto"  # one packed row per batch (no padding computed) or padded rows
    compile: Toggle = "auto"  # torch.compile the decoder layers (auto: on for CUDA)
    codec: str | None = None  # raw | zstd | fp8: how states are stored (a new run's default: raw)
    allow_partial: bool = False  # start even when the projected size exceeds free space
    allow_incomplete: bool = False  # --data is a generate run not finished yet: extract what it holds
    reserve_bytes: int | None = None  # kept free while running; None: max(1% of volume, 2x largest batch)
    backend: str | None = None  # transformers | vllm; a new run's default is transformers
    tensor_parallel: int | None = None  # transformers backend: one replica over this many devices (spec)
    expert_parallel: int | None = None  # ... with its routed experts split over this many (1 or the TP size)
    tensor_parallel_size: int | None = None  # vllm backend only; not part of the spec
    data_parallel_size: int | None = None  # vllm backend only; not part of the spec
    workers: int = 0  # scale-out: this many Ray workers, each on 1 GPU or a TP group (0: this process alone)
    ray_address: str | None = None  # join this Ray cluster; None: start a local one for the run
    metrics_port: int | None = None  # serve Prometheus' text format on this port while running
    metrics_textfile: Path | None = None  # keep this file in Prometheus' text format (node_exporter)

    def __post_init__(self) -> None:
        self.packing = toggle("packing", self.packing)
        self.compile = toggle("compile", self.compile)

    def telemetry(self, metrics: Callable[[], dict]) -> Telemetry:
        return Telemetry(self.out, metrics, self.metrics_port, self.metrics_textfile)

    def resources(self, device: str | None = None) -> Resources:
        return Resources(device or self.device or default_device(), self.writers, self.max_inflight_bytes)


def default_device() -> str:
    import torch  # here, not at import: a resume with nothing to do never loads torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_packing(packing: Toggle, device: str, config: dict, dtype: str, log: Callable[[str], None]) -> bool:
    """auto: pack on CUDA where the varlen kernel runs for every attention layer, padded rows
    otherwise (and the log says why); on: pack wherever packed rows can compute the model."""
    from hsx.capture.transformers import packing_refusal, varlen_blocker

    if packing == "off":
        return False
    if packing == "on":
        refusal = packing_refusal(config)
        if refusal is not None:
            raise OptionError(f"{refusal}: use --packing off")
        return True
    if not device.startswith("cuda"):
        return False
    blocker = varlen_blocker(config, device, dtype)
    if blocker is not None:
        log(f"packing: padded rows, since packed rows would be slower here: {blocker}")
    return blocker is None


def resolve_compile(compile: Toggle, device: str, backend: str) -> bool:
    """auto: compile on CUDA where Triton is installed (the element-wise kernels it fuses are a
    quarter of the forward there); on CPU the compile takes longer than most runs gain."""
    if backend != "transformers":
        if compile == "on":
            raise OptionError(f"--compile applies to the transformers backend, not {backend}")
        return False
    if compile == "auto":
        return device.startswith("cuda") and importlib.util.find_spec("triton") is not None
    return compile == "on"


def resolve_parallel(tensor: int | None, expert: int | None, config: dict, backend: str) -> Parallel:
    """The layout of one model replica, checked against the model: refused where it cannot split."""
    parallel = Parallel(tensor=tensor or 1, expert=expert or 1)
    if parallel.ranks == 1 and parallel.expert == 1:
        return parallel
    if backend != "transformers":
        raise OptionError(f"--tensor-parallel/--expert-parallel are the transformers backend's; {backend} has its own")
    from hsx.capture.transformers import parallel_refusal

    refusal = parallel_refusal(config, parallel.tensor, parallel.expert)
    if refusal is not None:
        raise OptionError(f"cannot lay the model over {parallel}: {refusal}")
    return parallel
