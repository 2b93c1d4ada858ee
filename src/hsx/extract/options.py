"""What the operator asked ``hsx extract`` for, parsed once: ``ExtractOptions`` (the job's shared
fields, ``job.options.JobOptions``, and extraction's own), their defaults and bounds (``EXTRACT``).

Options live at the top of the job; stages below it get resolved values (``backends.Resources``, a model
folder, a device), never the whole ``ExtractOptions``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated as A
from typing import ClassVar, Literal, get_args

from hsx.bounds import Bound, Bounds, Flag
from hsx.consumer import check_name
from hsx.drafts import check_preset
from hsx.errors import OptionError
from hsx.extract.backends import BACKENDS, Resources
from hsx.job.options import DEVICES, JOB, THREADS, TOKENS, JobOptions, check_device, check_vllm, default_device
from hsx.spec import Parallel, Window
from hsx.store.codec import DEFAULT_CODEC, Codec
from hsx.store.format import FinalStateNorm
from hsx.teacher import HELP as TEACHER_HELP

Toggle = Literal["auto", "on", "off"]
MAX_LAYER = 10_000  # a layer id past any model's (the model's own count is checked once it is read)
DEFAULTS = {
    "max_length": 4096,
    "batch_tokens": 16384,
    "shard_size": 1000,
    "dtype": "auto",
    "codec": DEFAULT_CODEC,
    "fidelity_stride": 8,
    "fidelity_floor": 0.98,
    "fidelity_drop": 0.5,
    "reference_every": 1000,
    "final_state": "post",
}
EXTRACT = Bounds(
    **JOB.bounds,
    max_length=TOKENS,
    batch_tokens=TOKENS,
    writers=THREADS,
    tensor_parallel=DEVICES,
    expert_parallel=DEVICES,
    pipeline_parallel=DEVICES,
    data_parallel_size=DEVICES,
    workers=Bound(min=0, max=100_000),
    quantized_compute=Bound(choices=("fp8", "int4", "dequantized")),
    expert_slice_gb=Bound(min=0.0, min_open=True, max=1e6),
    codec=Bound(choices=tuple(Codec)),
    backend=Bound(choices=tuple(BACKENDS)),
    packing=Bound(choices=get_args(Toggle)),
    compile=Bound(choices=get_args(Toggle)),
    fidelity_stride=TOKENS,
    fidelity_floor=Bound(min=0.0, max=1.0),
    fidelity_drop=Bound(min=0.0, max=1.0),
    reference_every=Bound(min=0, max=1_000_000_000),
    final_state=Bound(choices=get_args(FinalStateNorm)),
    window=Bound(min=1e-9, max=1e9),  # one byte at the least: the spec records whole bytes
    window_limit=Bound(min=1e-9, max=1e9),
)


WORKERS = (
    "Scale out: this many Ray workers, on 1 GPU or --tensor-parallel N each; 0: this process alone "
    "(needs the hsx[ray] extra)."
)
COMPUTE = (
    "FP8 checkpoints: fp8 (FP8 GEMMs, inputs quantized) | dequantized (weights expanded to the dtype). "
    "INT4-packed experts: int4 (a grouped GEMM that dequantizes them as it loads them, CUDA) | dequantized "
    "(expanded per layer, the default) (new run; part of the spec)."
)

SLICE = (
    "Expand a MoE layer's routed experts (packed or FP8) at most this many GB at a time, not the whole "
    "layer at once: the same states, less memory (new run; part of the spec)."
)

LAYERS = (
    "hsx layer ids, e.g. 1,15,28, or a draft preset: eagle3, dflash[:N] (N taps by DFlash's formula), "
    "mtp (none: the final state alone)."
)
FLOOR = "Stop where agreement with the target's own temperature-0 tokens falls under this (a resume: its session's)."
DROP = "On other data, stop where agreement falls by this share of the run's baseline (a resume: its session's)."


def layer_ids(value: str | None) -> list[int] | str | None:
    """``--layers``: explicit hsx layer ids, or a draft preset's name (``hsx.drafts``: resolved against
    the model); refused (``OptionError``) otherwise."""
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        return check_preset(value)


@dataclass
class ExtractOptions(JobOptions):
    COMMAND: ClassVar[str] = "extract"
    UNIT: ClassVar[str] = "samples"
    BOUNDS: ClassVar[Bounds] = EXTRACT

    # hsx layer ids, or a draft preset (hsx.drafts: eagle3, dflash:N, mtp)
    layers: A[list[int] | str | None, Flag(LAYERS, "IDS|PRESET", "eagle3: 1, N/2-1, N-4", str, layer_ids)] = None
    # the final state stored post-norm (a new run's default) or pre-norm
    final_state: A[FinalStateNorm | None, Flag("The final state stored before or after the final norm (new run).")] = (
        None
    )
    batch_tokens: A[int | None, Flag("Padded tokens per forward pass.")] = None
    writers: A[int, Flag("Writer threads.")] = 8
    max_inflight_bytes: int = 4 << 30
    # one packed row per batch (no padding computed) or padded rows
    packing: A[Toggle, Flag("Pack each batch into one row with no padding (auto: on for CUDA).")] = "auto"
    compile: A[Toggle, Flag("torch.compile the decoder layers (auto: on for CUDA).")] = "auto"
    # raw | zstd | fp8: how states are stored (a new run's: codec.DEFAULT_CODEC)
    codec: A[str | None, Flag("How states are stored (new run).")] = None
    # --data is a generate run not finished yet: extract what it holds
    allow_incomplete: A[bool, Flag("--data is an unfinished generate run: extract the conversations it holds.")] = False
    # transformers | vllm; a new run's default is transformers
    backend: A[str | None, Flag("What runs the model (new run).", default="transformers")] = None
    # transformers backend: one replica over this many devices (spec), its routed experts split over this many
    tensor_parallel: A[int | None, Flag("One model replica over N devices of this node (new run).", default="1")] = None
    expert_parallel: A[
        int | None, Flag("Split the routed experts over the tensor-parallel ranks (1 or N).", default="1")
    ] = None
    # ... in this many stages of contiguous layers, each over the TP size (spec)
    pipeline_parallel: A[
        int | None,
        Flag(
            "A pipeline of N stages of contiguous layers, each over --tensor-parallel devices (new run).", default="1"
        ),
    ] = None
    data_parallel_size: A[int | None, Flag("vllm backend: model replicas.", default="1")] = None  # not in the spec
    # scale-out: this many Ray workers, each on 1 GPU or a TP group (0: this process alone)
    workers: A[int, Flag(WORKERS)] = 0
    # join this Ray cluster; None: start a local one for the run
    ray_address: A[
        str | None, Flag("With --workers: join this Ray cluster.", "ADDRESS", "a local Ray for this run")
    ] = None
    # FP8 checkpoints: fp8 | dequantized (a new run's default: fp8 where it can)
    quantized_compute: A[str | None, Flag(COMPUTE, "MODE", "fp8 where the GPU can")] = None
    # GB of a MoE layer's routed experts expanded at once (spec); None: the whole layer's
    expert_slice_gb: A[float | None, Flag(SLICE, "GB", "a whole MoE layer's")] = None
    # hsx.fidelity: every N-th loss-masked token checked (spec); the floor and the drop that stop a
    # run (the spec's; a resume giving them sets its own session's)
    fidelity_stride: A[int | None, Flag("Check every N-th loss-masked token against the target's head (new run).")] = (
        None
    )
    fidelity_floor: A[float | None, Flag(FLOOR)] = None
    fidelity_drop: A[float | None, Flag(DROP)] = None
    # the target's distribution at each masked position, stored beside the states (hsx.teacher; spec)
    teacher: A[
        str | None,
        Flag(f"Store the target's distribution at each loss-masked position: {TEACHER_HELP} (new run).", "KIND:ARG"),
    ] = None
    # hsx.certify: 1 in N samples (by id, and the first few) recomputed through transformers' plain
    # path and compared tap by tap (spec; a resume giving it sets its own session's); 0: none
    reference_every: A[
        int | None,
        Flag("Recompute 1 in N samples through transformers' plain path and compare every tap (0: none).", "N"),
    ] = None
    # GB (10^9 bytes) of samples the named consumers have not released, at most (spec)
    window: A[
        float | None,
        Flag("Pause while the samples the --consumer trainers have not released exceed this many GB (new run).", "GB"),
    ] = None
    # GB the extraction may go on up to past the window while the consumers lag, and pauses at (spec)
    window_limit: A[
        float | None,
        Flag(
            "With --window: go on past the window up to this many GB while the --consumer trainers lag, "
            "and pause there (new run).",
            "GB",
        ),
    ] = None
    # the consumers the window waits for (hsx.data.StreamDataset's names)
    consumer: A[
        list[str] | None, Flag("A trainer the window waits for (its StreamDataset name); repeatable.", "NAME")
    ] = None
    # with --window: delete each file once every named consumer released it
    delete_released: A[
        bool, Flag("With --window: delete each sample file once every --consumer released it (new run).")
    ] = False
    # with --window: each sample's bytes also put in a data plane until released (hsx.plane)
    plane: A[
        str | None,
        Flag(
            "With --window: also put each sample in this Mooncake store until every --consumer released it, "
            "for trainers on nodes without the run's files (new run).",
            "mooncake://HOST:PORT",
        ),
    ] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device is not None and not self.workers:  # Ray workers' devices are theirs, not this machine's
            check_device(self.device)
        if self.backend == "vllm":
            check_vllm("--backend vllm")
        if isinstance(self.layers, str):
            check_preset(self.layers)
        elif self.layers is not None and not self.layers:
            raise OptionError("--layers names no layer: give ids, or the preset mtp for the final state alone")
        if (self.window is None) != (not self.consumer):
            raise OptionError("--window and --consumer go together: the window waits for the consumers named")
        if self.window_limit is not None:
            if self.window is None:
                raise OptionError("--window-limit needs --window: it is how far past the window the extraction goes")
            if int(self.window_limit * 1e9) <= int(self.window * 1e9):  # as the spec records them: whole bytes
                raise OptionError(
                    f"--window-limit {self.window_limit:g} is not larger than --window {self.window:g}: it is the "
                    "larger bound (GB) up to which the extraction goes on past the window while the consumers lag"
                )
        if self.delete_released and self.window is None:
            raise OptionError("--delete-released needs --window: the window's consumers are the ones that release")
        if self.plane is not None:
            if self.window is None:
                raise OptionError("--plane needs --window: a key leaves the plane once the consumers released it")
            from hsx.plane import check_available

            self.plane = str(check_available(self.plane))
        for name in self.consumer or []:
            check_name(name)
        seen: dict[Path, Path] = {}
        for path in map(Path, self.data):
            first = seen.setdefault(path.resolve(), path)
            if first is not path:
                also = "" if path == first else f" (also as {path})"
                raise OptionError(f"--data names {first} twice{also}: give each file once")
        ids = self.layers
        if isinstance(ids, list) and (min(ids) < 0 or max(ids) > MAX_LAYER or len(set(ids)) < len(ids)):
            raise OptionError(
                f"--layers takes distinct layer ids >= 0 and <= {MAX_LAYER}, not {','.join(map(str, ids))}"
            )
        if self.ray_address is not None and not self.workers:
            raise OptionError("--ray-address is where --workers run; without --workers nothing joins it")
        if self.workers and (self.pipeline_parallel or 1) > 1:
            raise OptionError(
                "--workers runs workers of one GPU or of a tensor-parallel group, not pipelines: "
                "omit --workers (one pipeline over this node's GPUs) or --pipeline-parallel"
            )

    def refuse_unused(self, backend: str, generated: bool) -> None:
        """Options the run would ignore, refused by name before anything is written: ``backend`` is
        the run's (its spec's on a resume), ``generated`` whether its data is a generate run."""
        engine = [Bounds.flag(k) for k in ("tensor_parallel_size", "data_parallel_size") if getattr(self, k)]
        if engine and backend != "vllm":
            raise OptionError(f"{' and '.join(engine)} size vLLM's engine; this run's backend is {backend}")
        if self.expert_slice_gb is not None and backend != "transformers":
            raise OptionError(f"--expert-slice-gb slices hsx's expansion of the experts; {backend} holds its own")
        if self.quantized_compute == "int4" and backend != "transformers":
            raise OptionError(f"--quantized-compute int4 runs hsx's own experts kernel; {backend} runs its own")
        if self.quantized_compute == "int4" and self.expert_slice_gb is not None:
            raise OptionError(
                "--expert-slice-gb slices the experts' expansion, and --quantized-compute int4 expands none: "
                "the GEMM reads them packed"
            )
        if self.reference_every is not None and backend == "vllm":
            raise OptionError(
                "--reference-every recomputes samples on the run's own loaded weights, and vLLM's engine holds its "
                "own: certify a vLLM run with hsx verify OUT --reference N"
            )
        if self.allow_incomplete and not generated:
            raise OptionError(
                "--allow-incomplete lets an extraction start on an unfinished generate run; "
                "this run's --data is not a generate run"
            )

    def window_asked(self) -> Window | None:
        """The window as the spec records it, where one was asked for."""
        if self.window is None:
            return None
        consumers = sorted(set(self.consumer or []))
        limit = None if self.window_limit is None else int(self.window_limit * 1e9)
        return Window(
            bytes=int(self.window * 1e9),
            consumers=consumers,
            delete=self.delete_released,
            plane=self.plane,
            limit=limit,
        )

    def resources(self, device: str | None = None) -> Resources:
        return Resources(device or self.device or default_device(), self.writers, self.max_inflight_bytes, self.threads)


def quickstart_options(out: Path, codec: str | None = None) -> ExtractOptions:
    """``hsx quickstart``: the bundled tiny model and conversations, offline, on CPU."""
    from hsx.tinymodel import bundled_path

    data = [bundled_path("data/sharegpt_dummy_conversation.json")]
    return ExtractOptions(
        out=out, model=str(bundled_path("tiny-llama")), data=data, device="cpu", shard_size=100, codec=codec
    )


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


def resolve_parallel(
    tensor: int | None, expert: int | None, config: dict, backend: str, pipeline: int | None = None
) -> Parallel:
    """The layout of one model replica, checked against the model: refused where it cannot split."""
    parallel = Parallel(tensor=tensor or 1, expert=expert or 1, pipeline=pipeline or 1)
    if parallel.ranks == 1 and parallel.expert == 1:
        return parallel
    if backend != "transformers":
        raise OptionError(
            f"--tensor-parallel/--expert-parallel/--pipeline-parallel are the transformers backend's; {backend} "
            "has its own"
        )
    from hsx.capture.transformers import parallel_refusal

    refusal = parallel_refusal(config, parallel.tensor, parallel.expert, parallel.pipeline)
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
