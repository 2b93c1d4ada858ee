"""What every job's operator asks for, parsed once: ``JobOptions``, the fields ``hsx extract`` and
``hsx generate`` share (the run folder, model, data, verification, space, telemetry), their bounds
(``JOB``), the ``--out`` checks, and the command that asks for exactly these options again.

Each stage derives its own options from it (``extract.options.ExtractOptions``,
``generate.options.GenerateOptions``) and names its command (``COMMAND``), which every message
the job layer prints uses: a refusal, a clean stop, a failed start.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from operator import not_
from pathlib import Path
from types import UnionType
from typing import Annotated as A
from typing import ClassVar, get_args, get_origin, get_type_hints

from hsx.bounds import Bound, Bounds, Flag
from hsx.errors import OptionError
from hsx.input import MAX_NESTING, json_depth, json_leaves
from hsx.progress import LOG_EVERY
from hsx.store import layout
from hsx.telemetry import Telemetry

# Every number has an upper end, past which it cannot be meant (and a real number is finite):
# a count of devices, threads or processes of one node, a length in tokens, a span of time.
DEVICES = Bound(min=1, max=1024)
THREADS = Bound(min=1, max=1024)
TOKENS = Bound(min=1, max=10**8)
DAY = 86_400.0
JOB = Bounds(
    shard_size=Bound(min=1, max=10**6),
    dtype=Bound(choices=("auto", "bfloat16", "float16", "float32")),
    tensor_parallel_size=DEVICES,
    metrics_port=Bound(min=1, max=65535),
    log_every=Bound(min=0.0, max=DAY, min_open=True),
    limit=Bound(min=1, max=10**9),  # sample ids have 9 digits
    threads=THREADS,
)
NOT_FLAGS = frozenset({"max_inflight_bytes", "reserve_bytes"})  # the Python API's alone
DATA = (
    "Conversations: .jsonl, .json or .parquet, a datasets folder or a cached Hugging Face dataset name; "
    "repeatable, each once."
)
TEMPLATE_NAME = "Which of the tokenizer's named chat templates renders (new run)."
KWARGS = "The chat template's arguments as JSON, e.g. '{\"enable_thinking\": false}' (new run)."


@dataclass
class JobOptions:
    """``None`` means "not given": a new run takes the stage's default, a resume the spec's value."""

    COMMAND: ClassVar[str]  # the stage's command: extract | generate
    UNIT: ClassVar[str]  # what its files are: samples | conversations
    BOUNDS: ClassVar[Bounds]  # its options' bounds (``JOB`` and its own)

    out: A[Path, Flag("Run folder (created, or resumed if it holds hsx.json).", "DIR")]
    model: A[str | None, Flag("Model folder or hub id (new run; or its new path on resume).", "PATH")] = None
    data: A[list[Path], Flag(DATA, "FILE")] = field(default_factory=list)
    # of the Hugging Face datasets among data (a new run's; part of the spec)
    split: A[str | None, Flag("The split of a Hugging Face dataset --data.", "NAME", "its only one")] = None
    # only the first rows of the data, over all sources (a new run's; in the spec)
    limit: A[int | None, Flag("Only the first N rows of the data.", default="all")] = None
    # the field of every row that holds its turns (None: conversations or messages)
    column: A[str | None, Flag("The field of each row that holds its turns.", "NAME", "conversations or messages")] = (
        None
    )
    # the chat template's arguments (enable_thinking...): a new run's, in its spec (vLLM's and SGLang's name)
    template_kwargs: A[
        dict | None, Flag(KWARGS, "JSON", "none", str, template_kwargs, name="--chat-template-kwargs")
    ] = None
    # which of the tokenizer's named chat templates renders (Hermes-3's and Command-R's ship default and
    # tool_use); None: as transformers and serving engines pick (tool_use for rows with tools). In the spec
    chat_template: A[
        str | None, Flag(TEMPLATE_NAME, "NAME", "tool_use for rows with tools, else default", name="--chat-template")
    ] = None
    threads: A[int | None, Flag("CPU: torch threads.", default="torch's")] = None  # None: torch's own choice
    max_length: A[int | None, Flag("Truncate samples to this many tokens.")] = None
    shard_size: A[int | None, Flag("Samples per shard folder.")] = None
    dtype: A[str | None, Flag("Model dtype.")] = None
    device: A[str | None, Flag("cpu, cuda or cuda:N.", "DEVICE", "cuda if available")] = None
    trust_remote_code: A[bool, Flag("Allow the model's own Python code.")] = False
    deep_verify: A[
        bool, Flag("On resume, check headers and sizes only, not digests.", parse=not_, name="--fast-verify")
    ] = True
    allow_partial: A[bool, Flag("Start even if the volume cannot hold the whole run; stop cleanly when it fills.")] = (
        False
    )
    reserve_bytes: int | None = None  # kept free while running; None: max(1% of volume, 2x largest batch)
    # the engine's own tensor parallelism (vLLM): not part of the spec
    tensor_parallel_size: A[int | None, Flag("vllm backend: GPUs per model replica.", default="1")] = None
    metrics_port: A[int | None, Flag("Serve the run's metrics in Prometheus' text format on this port.")] = None
    metrics_textfile: A[
        Path | None, Flag("Keep this file in Prometheus' text format (node_exporter's textfile).", "FILE")
    ] = None
    # seconds between progress lines off a terminal (hsx.progress)
    log_every: A[float, Flag("Off a terminal: seconds between progress lines.", "SECONDS")] = LOG_EVERY

    def __post_init__(self) -> None:
        """Refuse what cannot be meant, before anything is read or written."""
        self.BOUNDS.check(self)
        hints = get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if lone_item(hints[f.name], value):  # iterated, it would be read letter by letter
                raise OptionError(f"{flag_name(type(self), f.name)} takes a list of values, not the one {value!r}")
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, str | Path) and not str(v).strip():  # Path("") is "." and cannot be told
                    raise OptionError(f"{flag_name(type(self), f.name)} takes a value, not {v!r}")
        if self.out.is_file():
            raise OptionError(f"--out {self.out} is a file, not a run folder: name a new or empty folder, or a run")
        writable_folder(self.out, "--out")
        if self.metrics_textfile is not None:
            if self.metrics_textfile.is_dir():
                raise OptionError(f"--metrics-textfile {self.metrics_textfile} is a folder: name the file to keep")
            if not self.metrics_textfile.parent.is_dir():
                raise OptionError(
                    f"--metrics-textfile {self.metrics_textfile}: {self.metrics_textfile.parent} is not a folder"
                )
            writable_folder(self.metrics_textfile.parent, "--metrics-textfile")
        if self.template_kwargs is not None:
            check_template_kwargs(self.template_kwargs)

    def command(self) -> str:
        """The ``hsx COMMAND`` command that asks for exactly these options (local paths made
        absolute): what a start that did not become a run prints to start it again."""
        return command_line(self.COMMAND, self)

    def rows_asked(self) -> dict:
        """The row selection given (``column``, ``split``, ``limit``), for the drift check: a resume
        that names one without ``--data`` is checked against the run's data, never ignored."""
        return {k: getattr(self, k) for k in ("column", "split", "limit") if getattr(self, k) is not None}

    def telemetry(self, metrics: Callable[[], dict]) -> Telemetry:
        return Telemetry(self.out, metrics, self.metrics_port, self.metrics_textfile)


def lone_item(hint: object, value: object) -> bool:
    """Whether ``value`` is one str or path given (from Python) where the field takes a list of
    them, and no lone value: ``consumer="ab"`` was read as two consumers, ``a`` and ``b``."""
    args = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    alone = any(isinstance(value, a) for a in args if isinstance(a, type))
    return isinstance(value, str | Path) and not alone and any(get_origin(a) is list for a in args)


def template_kwargs(text: str | None) -> dict | None:
    """``--chat-template-kwargs '{"enable_thinking": false}'``: a JSON object, or a refusal naming the option."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        why = getattr(e, "msg", None) or "nested too deep"
        raise OptionError(f"--chat-template-kwargs must be a JSON object, not {text[:80]!r} ({why})") from None
    if not isinstance(value, dict):
        raise OptionError(f"--chat-template-kwargs must be a JSON object, not {text[:80]!r}")
    return value


# What hsx itself gives the chat template of each render (the conversation, its tools, whether the
# generation prompt follows, untokenized text), or what would replace the template or its output:
# from --chat-template-kwargs each would break every row's render or be silently overridden.
RENDER_ARGS = (
    "add_generation_prompt",
    "chat_template",
    "continue_final_message",
    "conversation",
    "messages",
    "return_assistant_tokens_mask",
    "return_dict",
    "tokenize",
    "tools",
)


def check_template_kwargs(value: dict) -> None:
    """What the spec can hold as JSON and read back the same: finite numbers, nested at most
    ``MAX_NESTING`` deep (JSON's ``NaN`` would be written as ``null``); none of ``RENDER_ARGS``."""
    if taken := sorted(set(value) & set(RENDER_ARGS)):
        raise OptionError(
            f"--chat-template-kwargs cannot set {', '.join(taken)}: hsx passes the conversation, its tools and "
            "the generation prompt to every render itself; give only the template's own variables "
            '(e.g. {"enable_thinking": false})'
        )
    if json_depth(value) > MAX_NESTING:
        raise OptionError(f"--chat-template-kwargs is nested deeper than {MAX_NESTING} levels (the nesting limit)")
    if not all(math.isfinite(v) for v in json_leaves(value) if isinstance(v, float)):
        raise OptionError("--chat-template-kwargs holds NaN or an infinity, which JSON cannot hold")


def command_line(verb: str, opts) -> str:
    """The ``hsx VERB`` command that asks for exactly the options of ``opts`` (a dataclass of a
    command's options; local paths made absolute)."""
    args = ["hsx", verb]
    for f in fields(opts):
        value = getattr(opts, f.name)
        if f.name in NOT_FLAGS or value == f.default or (f.default_factory is not MISSING and not value):
            continue
        flag = flag_name(type(opts), f.name)
        if value is True or f.name == "deep_verify":  # flags take no value (--fast-verify: deep_verify off)
            args.append(flag)
        elif f.name == "layers":
            args += [flag, ",".join(map(str, value)) if isinstance(value, list) else value]  # ids or a preset
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif isinstance(value, list):
            for item in value:
                local = f.name == "data" and Path(item).exists()  # a dataset's name stays as given
                args += [flag, str(Path(item).absolute()) if local else str(item)]
        elif f.name == "model" and Path(value).expanduser().exists():
            args += [flag, str(Path(value).expanduser().absolute())]
        else:
            args += [flag, str(value.absolute() if isinstance(value, Path) else value)]
    return shlex.join(args)


def flag_of(cls: type, name: str) -> Flag | None:
    """The ``Flag`` in the annotation of field ``name`` of the options dataclass ``cls`` (None: none)."""
    hint = get_type_hints(cls, include_extras=True)[name]
    return next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Flag)), None)


def flag_name(cls: type, name: str) -> str:
    flag = flag_of(cls, name)
    return flag.name if flag is not None and flag.name else Bounds.flag(name)


def resume_command(run: Path, model: str | None = None, command: str = "extract") -> str:
    """The command that resumes ``run`` (``command``: extract, or generate for a generate run); with
    ``model`` (where it moved: a local folder made absolute), which the resume checks against the
    fingerprint and records."""
    args = ["hsx", command, "--out", str(run)]
    if model is not None:
        local = Path(model).expanduser()
        args += ["--model", str(local.absolute()) if local.exists() else model]
    return shlex.join(args)


def writable_folder(path: Path, flag: str) -> None:
    """``path`` is a folder that can be written, or one that can be made: its nearest existing
    ancestor is a folder this process may write in (not a file, not a read-only mount)."""
    there = path
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise OptionError(f"{flag} {path}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK | os.X_OK):
        raise OptionError(f"{flag} {path}: {there} is not writable here (read-only, or not this user's)")


def interrupted(verb: str, out: Path, model: str | None, opts: JobOptions | None) -> str:
    """What a Ctrl-C or SIGTERM of ``hsx VERB`` says to do next, as things stand when it comes: a command
    that works as printed (a resume needs the spec, a start its options)."""
    if (out / layout.SPEC).is_file():
        return f"resume with: {resume_command(out, model, verb)}"
    if opts is None:
        return "nothing was started"
    return f"no run was made; start it again with: {opts.command()}"


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
