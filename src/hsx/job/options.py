"""What every job's operator asks for, parsed once: ``JobOptions``, the fields ``hsx extract`` and
``hsx generate`` share (the run folder, model, data, verification, space, telemetry), their bounds
(``JOB``), the ``--out`` checks, and the command that asks for exactly these options again.

Each stage derives its own options from it (``extract.options.ExtractOptions``,
``generate.options.GenerateOptions``) and names its command (``COMMAND``), which every message
the job layer prints uses: a refusal, a clean stop, a failed start.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from hsx.bounds import Bound, Bounds
from hsx.errors import OptionError
from hsx.telemetry import Telemetry

AT_LEAST_ONE = Bound(min=1)
JOB = Bounds(
    shard_size=AT_LEAST_ONE,
    dtype=Bound(choices=("auto", "bfloat16", "float16", "float32")),
    tensor_parallel_size=AT_LEAST_ONE,
    metrics_port=Bound(min=1, max=65535),
)
NOT_FLAGS = frozenset({"max_inflight_bytes", "reserve_bytes"})  # the Python API's alone
FLAG_NAMES = {"servers": "--server", "deep_verify": "--fast-verify"}  # fields whose flag is not their name


@dataclass
class JobOptions:
    """``None`` means "not given": a new run takes the stage's default, a resume the spec's value."""

    COMMAND: ClassVar[str]  # the stage's command: extract | generate
    UNIT: ClassVar[str]  # what its files are: samples | conversations
    BOUNDS: ClassVar[Bounds]  # its options' bounds (``JOB`` and its own)

    out: Path
    model: str | None = None
    data: list[Path] = field(default_factory=list)
    max_length: int | None = None
    shard_size: int | None = None
    dtype: str | None = None
    device: str | None = None
    trust_remote_code: bool = False
    deep_verify: bool = True
    allow_partial: bool = False  # start even when the projected size exceeds free space
    reserve_bytes: int | None = None  # kept free while running; None: max(1% of volume, 2x largest batch)
    tensor_parallel_size: int | None = None  # the engine's own tensor parallelism (vLLM): not part of the spec
    metrics_port: int | None = None  # serve Prometheus' text format on this port while running
    metrics_textfile: Path | None = None  # keep this file in Prometheus' text format (node_exporter)

    def __post_init__(self) -> None:
        """Refuse what cannot be meant, before anything is read or written."""
        self.BOUNDS.check(self)
        if self.out.is_file():
            raise OptionError(f"--out {self.out} is a file, not a run folder: name a new or empty folder, or a run")

    def command(self) -> str:
        """The ``hsx COMMAND`` command that asks for exactly these options (local paths made
        absolute): what a start that did not become a run prints to start it again."""
        return command_line(self.COMMAND, self)

    def telemetry(self, metrics: Callable[[], dict]) -> Telemetry:
        return Telemetry(self.out, metrics, self.metrics_port, self.metrics_textfile)


def command_line(verb: str, opts) -> str:
    """The ``hsx VERB`` command that asks for exactly the options of ``opts`` (a dataclass of a
    command's options; local paths made absolute)."""
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
                args += [flag, str(Path(item).absolute()) if f.name == "data" else item]
        elif f.name == "model" and Path(value).expanduser().exists():
            args += [flag, str(Path(value).expanduser().absolute())]
        else:
            args += [flag, str(value.absolute() if isinstance(value, Path) else value)]
    return shlex.join(args)
