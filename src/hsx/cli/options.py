"""Every option of the command line, declared once.

The job commands (``hsx extract``, ``hsx generate``) take exactly the fields of their options
dataclass: ``parameters`` makes a command's parameters from those fields, each read as ``FLAGS``
says under the field's name, bounded by the command's ``Bounds`` (in the help, and refused while
parsing), its default shown from the command's defaults, its flag spelled as ``command_line``
writes it back. A new option of a job is a field on its dataclass (with its bound), and its entry
in ``FLAGS``; a field without an entry fails at import, so none is left off the command line.
The other commands share the aliases below (``RunFolder``, ``Threads``, ...).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin, get_type_hints

import typer

from hsx.bounds import EXPORT, VOCAB, Bound, Bounds
from hsx.drafts import check_preset
from hsx.errors import OptionError
from hsx.extract.options import DEFAULTS, EXTRACT
from hsx.generate.toolcalls import PARSERS
from hsx.job.options import DEVICES, FLAG_NAMES, NOT_FLAGS, THREADS, TOKENS, template_kwargs


def layer_ids(value: str | None) -> list[int] | str | None:
    """Explicit hsx layer ids, or a draft preset's name (``hsx.drafts``: resolved against the model)."""
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        pass
    try:
        return check_preset(value)
    except OptionError as e:
        raise typer.BadParameter(str(e)) from None


@dataclass(frozen=True)
class Flag:
    """How a field reads on the command line. ``default``: the default the help shows where the
    field's own is None (not given) and the command's defaults say none; ``typed`` and ``parse``:
    what is typed, and the field's value from it, where that is not the field's own type."""

    help: str
    metavar: str | None = None
    default: str | None = None
    typed: Any = None
    parse: Callable[[Any], Any] | None = None


FLAGS = {
    "out": Flag("Run folder (created, or resumed if it holds hsx.json).", "DIR"),
    "model": Flag("Model folder or hub id (new run; or its new path on resume).", "PATH"),
    "data": Flag(
        "Conversations: .jsonl, .json or .parquet, a datasets folder or a cached Hugging Face dataset name; "
        "repeatable, each once.",
        "FILE",
    ),
    "split": Flag("The split of a Hugging Face dataset --data.", "NAME", "its only one"),
    "limit": Flag("Only the first N rows of the data.", default="all"),
    "column": Flag("The field of each row that holds its turns.", "NAME", "conversations or messages"),
    "threads": Flag("CPU: torch threads.", default="torch's"),
    "template_kwargs": Flag(
        "The chat template's arguments as JSON, e.g. '{\"enable_thinking\": false}' (new run).",
        "JSON",
        "none",
        str,
        template_kwargs,
    ),
    "layers": Flag(
        "hsx layer ids, e.g. 1,15,28, or a draft preset: eagle3, dflash[:N] (N taps by DFlash's formula), "
        "mtp (none: the final state alone).",
        "IDS|PRESET",
        "eagle3: 1, N/2-1, N-4",
        str,
        layer_ids,
    ),
    "final_state": Flag("The final state stored before or after the final norm (new run).", default="post"),
    "max_length": Flag("Truncate samples to this many tokens."),
    "batch_tokens": Flag("Padded tokens per forward pass."),
    "dtype": Flag("Model dtype."),
    "device": Flag("cpu, cuda or cuda:N.", "DEVICE", "cuda if available"),
    "shard_size": Flag("Samples per shard folder."),
    "trust_remote_code": Flag("Allow the model's own Python code."),
    "writers": Flag("Writer threads."),
    "deep_verify": Flag("On resume, check headers and sizes only, not digests.", parse=operator.not_),
    "packing": Flag("Pack each batch into one row with no padding (auto: on for CUDA)."),
    "compile": Flag("torch.compile the decoder layers (auto: on for CUDA)."),
    "codec": Flag("How states are stored (new run)."),
    "window": Flag(
        "Pause while the samples the --consumer trainers have not released exceed this many GB (new run).", "GB"
    ),
    "consumer": Flag("A trainer the window waits for (its StreamDataset name); repeatable.", "NAME"),
    "delete_released": Flag("With --window: delete each sample file once every --consumer released it (new run)."),
    "allow_partial": Flag("Start even if the volume cannot hold the whole run; stop cleanly when it fills."),
    "allow_incomplete": Flag("--data is an unfinished generate run: extract the conversations it holds."),
    "backend": Flag("What runs the model (new run).", default="transformers"),
    "tensor_parallel": Flag("One model replica over N devices of this node (new run).", default="1"),
    "expert_parallel": Flag("Split the routed experts over the tensor-parallel ranks (1 or N).", default="1"),
    "pipeline_parallel": Flag(
        "A pipeline of N stages of contiguous layers, each over --tensor-parallel devices (new run).", default="1"
    ),
    "tensor_parallel_size": Flag("vllm backend: GPUs per model replica.", default="1"),
    "data_parallel_size": Flag("vllm backend: model replicas.", default="1"),
    "workers": Flag(
        "Scale out: this many Ray workers, on 1 GPU or --tensor-parallel N each; 0: this process alone "
        "(needs the hsx[ray] extra)."
    ),
    "ray_address": Flag("With --workers: join this Ray cluster.", "ADDRESS", "a local Ray for this run"),
    "metrics_port": Flag("Serve the run's metrics in Prometheus' text format on this port."),
    "metrics_textfile": Flag("Keep this file in Prometheus' text format (node_exporter's textfile).", "FILE"),
    "quantized_compute": Flag(
        "FP8 checkpoints: fp8 (FP8 GEMMs, inputs quantized) | dequantized (weights expanded to the dtype) "
        "(new run; part of the spec).",
        "MODE",
        "fp8 where the GPU can",
    ),
    "fidelity_stride": Flag("Check every N-th loss-masked token against the target's head (new run)."),
    "fidelity_floor": Flag(
        "Stop where agreement with the target's own temperature-0 tokens falls under this (a resume: its session's)."
    ),
    "fidelity_drop": Flag(
        "On other data, stop where agreement falls by this share of the run's baseline (a resume: its session's)."
    ),
    # hsx generate's own
    "turns": Flag("all: every assistant turn, on the target's own answers; last: the last only."),
    "temperature": Flag("0: greedy."),
    "top_p": Flag("Nucleus sampling (1: off)."),
    "top_k": Flag("Top-k sampling (0: off)."),
    "max_new_tokens": Flag("New tokens per turn at most."),
    "drop": Flag(
        "Reject conversations with an empty or length-cut answer (comma-separated).",
        "empty,length",
        "none",
        parse=lambda v: [x for s in v or [] for x in s.split(",")] or None,
    ),
    "samples_per_prompt": Flag("Conversations generated per input row."),
    "seed": Flag("The run's seed; each request's derives from it."),
    "tool_parser": Flag(
        f"How the target's tool calls are read: {', '.join(PARSERS)}.", "NAME", "the tokenizer's response template"
    ),
    "servers": Flag("server backend: an OpenAI-compatible base URL; repeatable.", "URL", "none"),
    "concurrency": Flag("server backend: requests in flight per server.", default="64"),
    "server_api": Flag(
        "server backend: openai (/v1/completions), openai-chat (/v1/chat/completions) or sglang (/generate).",
        default="found out per server",
    ),
    "server_model": Flag("server backend: the served model's name.", "NAME", "its only one"),
    "max_pending": Flag("Requests kept submitted to the engine.", default="the engine's own choice"),
    "server_timeout": Flag("server backend: seconds a request may take.", "SECONDS", "3600"),
    "server_retries": Flag("server backend: tries of a request on a server.", default="5"),
    "server_backoff": Flag("server backend: first wait between tries, doubling.", "SECONDS", "1"),
    "log_every": Flag("Off a terminal: seconds between progress lines.", "SECONDS"),
}


def option(name: str, bounds: Bounds = EXTRACT, defaults: Mapping[str, Any] = DEFAULTS, flag: Flag | None = None):
    """The ``typer.Option`` of field ``name`` (``flag``: in place of its ``FLAGS`` entry)."""
    flag = flag or FLAGS[name]
    shown = defaults.get(name, flag.default)
    kw = {"help": flag.help, "metavar": flag.metavar, "show_default": None if shown is None else str(shown)}
    kw = {k: v for k, v in kw.items() if v is not None}
    decl = FLAG_NAMES.get(name, Bounds.flag(name))
    return bounds.option(name, decl, **kw) if name in bounds.bounds else typer.Option(decl, **kw)


def parameters(
    cls: type, bounds: Bounds, defaults: Mapping[str, Any], **flags: Flag
) -> tuple[inspect.Signature, Callable[[dict], Any]]:
    """A command's parameters, one per field of the options dataclass ``cls`` (``flags``: entries
    in place of ``FLAGS``' for this command), and what builds ``cls`` from the values given. A flag
    is off unless given; a list is given by repeating its option."""
    hints = get_type_hints(cls)
    params, parse = [], {}
    for f in fields(cls):
        if f.name in NOT_FLAGS:
            continue
        flag = flags.get(f.name) or FLAGS.get(f.name)
        if flag is None:
            raise TypeError(f"{cls.__name__}.{f.name}: no entry in hsx.cli.options.FLAGS (or NOT_FLAGS if no option)")
        typed, default = flag.typed or hints[f.name], f.default
        if get_origin(typed) is Literal:
            typed = str
        elif get_origin(typed) is list:
            typed, default, parse[f.name] = typed | None, None, lambda v: list(v or [])
        if typed is bool:
            default = False
        if flag.parse:
            parse[f.name] = flag.parse
        if f.default is MISSING and f.default_factory is MISSING:
            default = inspect.Parameter.empty
        annotation = Annotated[typed, option(f.name, bounds, defaults, flag)]
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))

    def build(given: dict) -> Any:
        return cls(**{name: parse[name](v) if name in parse else v for name, v in given.items()})

    return inspect.Signature(params), build


# the bounds of the commands without an options dataclass
RUN = Bounds(threads=THREADS, size=VOCAB, target_vocab=VOCAB, fidelity_files=Bound(min=1, max=10**6))
TO = EXPORT  # hsx export's
BENCH = Bounds(
    samples=Bound(min=1, max=10**7),
    mean_len=TOKENS,
    min_len=TOKENS,
    max_len=TOKENS,
    batch_tokens=TOKENS,
    naive_samples=Bound(min=0, max=10**7),
    writers=THREADS,
    compile=EXTRACT.bounds["compile"],
    max_new_tokens=TOKENS,
    tensor_parallel_size=DEVICES,
    fidelity_stride=TOKENS,
)
MEMORY = Bounds(
    tensor_parallel=DEVICES,
    expert_parallel=DEVICES,
    pipeline_parallel=DEVICES,
    allreduce_gbps=Bound(min=0.0, max=100_000.0, min_open=True),
    p2p_gbps=Bound(min=0.0, max=100_000.0, min_open=True),
    interconnect=Bound(choices=("nvlink", "pcie")),
    batch_tokens=TOKENS,
    max_length=TOKENS,
    gpus=DEVICES,
    gpu_memory=Bound(min=0.0, max=100_000.0, min_open=True),
    experts=Bound(choices=("auto", "packed", "dequantized")),
    dtype=Bound(choices=("bfloat16", "float16", "float32")),
)

RunFolder = Annotated[Path, typer.Argument(metavar="OUT", help="Run folder.", file_okay=False, show_default=False)]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable report on stdout.")]
Deep = Annotated[bool, typer.Option("--deep", help="Verify every file's digest (reads all data), not only headers.")]
Threads = Annotated[int, RUN.option("threads", help="Parallel readers.")]
MovedModel = Annotated[str | None, typer.Option(metavar="PATH", help="The run's model, if it moved.")]
TargetVocab = Annotated[
    int | None, RUN.option("target_vocab", help="Target vocabulary size.", show_default="the model's config")
]
AllowIncomplete = Annotated[
    bool, typer.Option("--allow-incomplete", help="Export what an unfinished run has finished.")
]
Device = Annotated[str | None, option("device")]
Codec = Annotated[str | None, option("codec")]
