"""Every option of the command line, made from the options it sets.

A command whose options are a dataclass (``hsx extract``, ``generate``, ``bench``, ``memory``) takes
exactly its fields: ``parameters`` makes a parameter of each, read as its ``Flag`` says (the field's
annotation: ``bounds.Flag``), bounded by the command's ``Bounds`` (in the help, and refused while
parsing), its default shown from the command's defaults, its flag spelled as ``command_line`` writes
it back. A new option is a field with its ``Flag`` (and its bound); a field with neither a ``Flag`` nor
a place in ``NOT_FLAGS`` fails at import, so none is left off the command line. The other commands
share the aliases below (``RunFolder``, ``Threads``, ...).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin, get_type_hints

import typer

from hsx.bounds import EXPORT, VOCAB, Bound, Bounds, Flag
from hsx.extract.options import DEFAULTS, EXTRACT, ExtractOptions
from hsx.job.options import NOT_FLAGS, THREADS, flag_name, flag_of


def option(cls: type, name: str, bounds: Bounds, defaults: Mapping[str, Any], flag: Flag) -> Any:
    """The ``typer.Option`` of field ``name`` of ``cls``."""
    shown = defaults.get(name, flag.default)
    kw = {"help": flag.help, "metavar": flag.metavar, "show_default": None if shown is None else str(shown)}
    kw = {k: v for k, v in kw.items() if v is not None}
    decl = flag_name(cls, name)
    return bounds.option(name, decl, **kw) if name in bounds.bounds else typer.Option(decl, **kw)


def field_option(cls: type, name: str, bounds: Bounds, defaults: Mapping[str, Any] = {}) -> Any:
    """The ``typer.Option`` of field ``name`` of ``cls``, for a command that takes only some of its fields."""
    return option(cls, name, bounds, defaults, flag_of(cls, name))


def parameters(
    cls: type, bounds: Bounds, defaults: Mapping[str, Any] = {}
) -> tuple[inspect.Signature, Callable[[dict], Any]]:
    """A command's parameters, one per field of the options dataclass ``cls``, and what builds ``cls``
    from the values given. A flag is off unless given; a list is given by repeating its option."""
    hints = get_type_hints(cls)
    params, parse = [], {}
    for f in fields(cls):
        if f.name in NOT_FLAGS:
            continue
        flag = flag_of(cls, f.name)
        if flag is None:
            raise TypeError(f"{cls.__name__}.{f.name}: no Flag in its annotation (or NOT_FLAGS if no option)")
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
        annotation = Annotated[typed, option(cls, f.name, bounds, defaults, flag)]
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))

    def build(given: dict) -> Any:
        return cls(**{name: parse[name](v) if name in parse else v for name, v in given.items()})

    return inspect.Signature(params), build


def command(cls: type, bounds: Bounds, call: Callable[..., None], defaults: Mapping[str, Any] = {}) -> Callable:
    """A command whose parameters are ``cls``'s fields: ``call(build, given)`` with what builds the options
    and the values given (``call``'s name, less a leading underscore, and docstring are the command's)."""
    signature, build = parameters(cls, bounds, defaults)

    def parsed(**given: Any) -> None:
        call(lambda: build(given), given)

    parsed.__signature__, parsed.__name__, parsed.__doc__ = signature, call.__name__.lstrip("_"), call.__doc__
    return parsed


# the bounds of the commands that read a run
FILES = Bound(min=0, max=10**6)
RUN = Bounds(threads=THREADS, size=VOCAB, target_vocab=VOCAB, fidelity_files=Bound(min=1, max=10**6), reference=FILES)
TO = EXPORT  # hsx export's

RunFolder = Annotated[Path, typer.Argument(metavar="OUT", help="Run folder.", file_okay=False, show_default=False)]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable report on stdout.")]
Deep = Annotated[bool, typer.Option("--deep", help="Verify every file's digest (reads all data), not only headers.")]
Threads = Annotated[int, RUN.option("threads", help="Parallel readers.")]
MovedModel = Annotated[str | None, typer.Option(metavar="PATH", help="The run's model, if it moved.")]
TargetVocab = Annotated[
    int | None, RUN.option("target_vocab", help="Target vocabulary size.", show_default="the model's config")
]
Device = Annotated[str | None, field_option(ExtractOptions, "device", EXTRACT, DEFAULTS)]
AllowIncomplete = Annotated[
    bool, typer.Option("--allow-incomplete", help="Export what an unfinished run has finished.")
]
