"""What the operator asked for, parsed once: ``ExtractOptions``, their defaults and bounds (``EXTRACT``).

Options live at the top of the job; stages below it get resolved values (``Resources``, a model
folder, a device), never the whole ``ExtractOptions``.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args

from hsx.bounds import Bound, Bounds
from hsx.errors import OptionError
from hsx.spec import Parallel
from hsx.store.codec import DEFAULT_CODEC, Codec
from hsx.telemetry import Telemetry

Toggle = Literal["auto", "on", "off"]
Backend = Literal["transformers", "vllm"]
DEFAULTS = {"max_length": 4096, "batch_tokens": 16384, "shard_size": 1000, "dtype": "auto", "codec": DEFAULT_CODEC}
AT_LEAST_ONE = Bound(min=1)
EXTRACT = Bounds(
    max_length=AT_LEAST_ONE,
    batch_tokens=AT_LEAST_ONE,
    shard_size=AT_LEAST_ONE,
    writers=AT_LEAST_ONE,
    tensor_parallel=AT_LEAST_ONE,
    expert_parallel=AT_LEAST_ONE,
    tensor_parallel_size=AT_LEAST_ONE,
    data_parallel_size=AT_LEAST_ONE,
    workers=Bound(min=0),
    limit=AT_LEAST_ONE,
    threads=AT_LEAST_ONE,
    metrics_port=Bound(min=1, max=65535),
    dtype=Bound(choices=("auto", "bfloat16", "float16", "float32")),
    codec=Bound(choices=tuple(Codec)),
    backend=Bound(choices=get_args(Backend)),
    packing=Bound(choices=get_args(Toggle)),
    compile=Bound(choices=get_args(Toggle)),
)


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
    split: str | None = None  # of the Hugging Face datasets among data (a new run's; part of the spec)
    limit: int | None = None  # only the first rows of the data, over all sources (a new run's; in the spec)
    threads: int | None = None  # CPU: torch's threads (None: torch's own choice)
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
    codec: str | None = None  # raw | zstd | fp8: how states are stored (a new run's: codec.DEFAULT_CODEC)
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
    quantized_compute: str | None = None  # FP8 checkpoints: fp8 | dequantized (a new run's default: fp8 where it can)

    def __post_init__(self) -> None:
        """Refuse what cannot be meant, before anything is read or written."""
        EXTRACT.check(self)
        if self.out.is_file():
            raise OptionError(f"--out {self.out} is a file, not a run folder: name a new or empty folder, or a run")
        if self.device is not None and not self.workers:  # Ray workers' devices are theirs, not this machine's
            check_device(self.device)
        if self.backend == "vllm":
            check_vllm("--backend vllm")
        seen: dict[Path, Path] = {}
        for path in map(Path, self.data):
            first = seen.setdefault(path.resolve(), path)
            if first is not path:
                also = "" if path == first else f" (also as {path})"
                raise OptionError(f"--data names {first} twice{also}: give each file once")

    def command(self) -> str:
        """The ``hsx extract`` command that asks for exactly these options (local paths made
        absolute): what a start that did not become a run prints to start it again."""
        return command_line("extract", self)

    def telemetry(self, metrics: Callable[[], dict]) -> Telemetry:
        return Telemetry(self.out, metrics, self.metrics_port, self.metrics_textfile)

    def resources(self, device: str | None = None) -> Resources:
        return Resources(device or self.device or default_device(), self.writers, self.max_inflight_bytes)


NOT_FLAGS = frozenset({"max_inflight_bytes", "reserve_bytes"})  # the Python API's alone
FLAG_NAMES = {"servers": "--server", "deep_verify": "--fast-verify"}  # fields whose flag is not their name


def command_line(verb: str, opts) -> str:
    """The ``hsx VERB`` command that asks for exactly the options of ``opts`` (a dataclass of a
    command's options; local paths made absolute): what a start that did not become a run prints
    to start it again."""
    args = ["hsx", verb]
    for f in fields(opts):
        value = getattr(opts, f.name)
        if f.name in NOT_FLAGS or value == f.default or (f.default_factory is not MISSING and not value):
            continue
        flag = FLAG_NAMES.get(f.name, Bounds.flag(f.name))
        if value is True or f.name == "deep_verify":  # flags take no value (--fast-verify: deep_verify off)
            args.append(flag)
        elif f.name == "layers":
            args += [flag, ",".join(map(str, value))]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif isinstance(value, list):
            for item in value:
                local = f.name == "data" and Path(item).exists()  # a dataset's name stays as given
                args += [flag, str(Path(item).absolute()) if local else item]
        elif f.name == "model" and Path(value).expanduser().exists():
            args += [flag, str(Path(value).expanduser().absolute())]
        else:
            args += [flag, str(value.absolute() if isinstance(value, Path) else value)]
    return shlex.join(args)


def check_device(device: str) -> None:
    """A device this machine has; refused before a run folder is made or a dtype chosen for it."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise OptionError(f"--device takes cpu, cuda or cuda:N, not {device!r}")
    if d.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise OptionError(f"--device {device}: {why}; use --device cpu")
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:
        raise OptionError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")


def check_vllm(what: str) -> None:
    """vLLM is installed, or ``what`` is refused by name before anything is written."""
    if importlib.util.find_spec("vllm") is None:
        raise OptionError(f"{what} needs vLLM, which is not installed here: pip install vllm (see docs/vllm.md)")


def set_threads(threads: int | None, device: str) -> None:
    """``--threads``: torch's CPU threads for this process's model (on a shared machine torch's default,
    one per core, can run many times slower than one); None keeps torch's choice."""
    if threads is not None and device == "cpu":
        import torch

        torch.set_num_threads(threads)


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
    parallel = Parallel(tensor=1 if tensor is None else tensor, expert=1 if expert is None else expert)
    if parallel.ranks == 1 and parallel.expert == 1:
        return parallel
    if backend != "transformers":
        raise OptionError(f"--tensor-parallel/--expert-parallel are the transformers backend's; {backend} has its own")
    from hsx.capture.transformers import parallel_refusal

    refusal = parallel_refusal(config, parallel.tensor, parallel.expert)
    if refusal is not None:
        raise OptionError(f"cannot lay the model over {parallel}: {refusal}")
    return parallel


def check_gpus(parallel: Parallel, gpus: int) -> None:
    """One GPU per rank of a replica, on one node: refused where the node has fewer."""
    if gpus < parallel.ranks:
        raise OptionError(f"the run is laid over {parallel.ranks} GPUs ({parallel}); the node has {gpus}")


def resolve_quantized_compute(
    asked: str | None, model_dir: Path, device: str, dtype: str, parallel: Parallel, log: Callable[[str], None]
) -> str | None:
    """How an FP8 checkpoint computes in a new run (None for other checkpoints): ``fp8`` by default
    where torch's block-scaled FP8 GEMM runs and the layout keeps whole blocks per rank, else
    ``dequantized`` (the log says why); a choice that cannot run here is refused with the reason."""
    from hsx.capture import checkpoint
    from hsx.capture.quantized import fp8

    compute, why = checkpoint.compute_choice(model_dir, device, dtype, asked)
    if compute == "fp8":
        refusal = fp8.parallel_refusal(checkpoint.read_config(model_dir), parallel.tensor)
        if refusal is not None:
            if asked == "fp8":
                raise OptionError(f"--quantized-compute fp8 cannot lay the model over {parallel}: {refusal}")
            compute, why = "dequantized", refusal
    if why is not None:  # what runs is said at the load; here only why it is not fp8
        log(f"quantized compute: {compute}, since {why}")
    return compute
