"""The values each option allows, declared once per command: the command line shows and enforces
them while parsing, and the Python API refuses the same values (``OptionError``) before anything
is written. A given value is never swapped for a default: it is allowed or refused. How a field of
an options dataclass reads on the command line (its help, metavar, what is typed) is its ``Flag``,
beside it in its annotation; the command line is made from them (``cli.options.parameters``).

    EXTRACT = Bounds(max_length=Bound(min=1), dtype=Bound(choices=("auto", "float32")))

    # cli.py: the range or the choices in the help; a value outside them refused while parsing
    max_length: Annotated[int | None, EXTRACT.option("max_length", help="...")] = None
    # the options object (its __post_init__): the same refusal for a Python caller
    EXTRACT.check(self)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hsx.drafts import DRAFT_TYPES
from hsx.errors import OptionError


@dataclass(frozen=True)
class Flag:
    """How a field of an options dataclass reads on the command line, in its annotation:
    ``model: Annotated[str | None, Flag("Model folder or hub id.", "PATH")] = None``. ``default``: the
    default the help shows where the field's own is None (not given) and the command's defaults say
    none; ``typed`` and ``parse``: what is typed, and the field's value from it, where that is not the
    field's own type; ``name``: the flag where it is not the field's name."""

    help: str
    metavar: str | None = None
    default: str | None = None
    typed: Any = None
    parse: Callable[[Any], Any] | None = None
    name: str | None = None


@dataclass(frozen=True)
class Bound:
    """A number within [min, max] (an end left out is open-ended; ``min_open``/``max_open``
    exclude the end itself), or one of ``choices``. Ends written as ints bound an integer
    (``Bound(min=1)``), as floats a real number (``Bound(min=0.0, max=1.0, min_open=True)``).
    A real number is finite, whatever its ends: NaN passes every comparison and an infinity every
    open end, and neither can be written into a spec as JSON (``--temperature nan`` once became
    ``null`` there, and the run could no longer be read)."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    choices: tuple[str, ...] = ()

    def allowed(self) -> str:
        if self.choices:
            *rest, last = self.choices
            return f"{', '.join(rest)} or {last}" if rest else last
        ends = []
        if self.min is not None:
            ends.append(f"{'>' if self.min_open else '>='} {self.min}")
        if self.max is not None:
            ends.append(f"{'<' if self.max_open else '<='} {self.max}")
        return f"{'an integer' if self.integer else 'a number'} {' and '.join(ends)}".rstrip()

    @property
    def integer(self) -> bool:
        return all(isinstance(x, int) for x in (self.min, self.max) if x is not None)

    def admits(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, int if self.integer else int | float):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.min is not None and (value <= self.min if self.min_open else value < self.min):
            return False
        return self.max is None or (value < self.max if self.max_open else value <= self.max)

    def refuse(self, flag: str, value: Any) -> OptionError:
        return OptionError(f"{flag} takes {self.allowed()}, not {value!r}")


class Bounds:
    """One command's bounded options, by the name of their parameter (and field): ``--max-length``
    is ``max_length``."""

    def __init__(self, **bounds: Bound):
        self.bounds = bounds

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    def check(self, values: Any) -> None:
        """Refuse the first value out of its bound (``values``: an object with the names as
        attributes); None means not given and is left to the command's default."""
        for name, bound in self.bounds.items():
            value = getattr(values, name)
            if value is not None and not bound.admits(value):
                raise bound.refuse(self.flag(name), value)

    def option(self, name: str, *decls: str, **kw: Any) -> Any:
        """``typer.Option`` for ``name``: its bound in the help, and a value outside it refused while
        parsing, with the words of ``check`` (exit 2, as every refusal)."""
        import typer

        from hsx.errors import Exit

        bound = self.bounds[name]
        flag = next((d for d in decls if d.startswith("--")), self.flag(name))

        def within(value: Any) -> Any:
            for v in value if isinstance(value, list | tuple) else [value]:
                if v is not None and not bound.admits(v):
                    typer.echo(f"error: {bound.refuse(flag, v)}", err=True)
                    raise typer.Exit(Exit.ACT)
            return value

        if bound.choices:
            kw.setdefault("metavar", "[" + "|".join(bound.choices) + "]")
        else:
            kw.setdefault("metavar", "N" if bound.integer else "X")
            kw["help"] = f"{kw.get('help', '').rstrip('.')} ({bound.allowed()})."
        return typer.Option(*decls, callback=within, **kw)


VOCAB = Bound(min=1, max=10**7)  # a vocabulary's size
# ``hsx export``'s (here, not beside ``ExportOptions``: the command line reads them without torch)
EXPORT = Bounds(
    to=Bound(choices=("specforge", "speculators", "modelopt", "deepspec", "automodel")),
    draft=Bound(choices=DRAFT_TYPES),
    draft_vocab=VOCAB,
    target_vocab=VOCAB,
    pace=Bound(min=0.0, max=60.0),
)
