"""Where the command line prints, and the one place errors become exit codes.

Results go to stdout (``hsx memory ... > plan.txt`` holds the plan); progress, warnings and errors
to stderr. Both print text as it is: a square bracket in a path or a message is text, never console
markup (``pip install 'hsx[ray]'``, a data file ``convs[v2].jsonl``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.text import Text

from hsx.errors import CleanStop, DiskFull, Exit, HsxError, Terminated, stop
from hsx.progress import console

# status's and verify's checklist on stdout: its colours are markup, its text escaped (assess.status)
checklist = Console(highlight=False, soft_wrap=True)


def log(message: str) -> None:
    """A job's progress and warnings, on stderr."""
    console.print(message)


def print_summary(result) -> None:
    """What a command did (anything with ``lines()``), on stdout."""
    print(*result.lines(), sep="\n")


def fail(message: str, code: int) -> typer.Exit:
    console.print(Text.assemble(("error:", "bold red"), " ", message))
    return typer.Exit(code)


@contextmanager
def failures(interrupted: Callable[[], str] | None = None) -> Iterator[None]:
    """hsx's own errors print their message and exit with their code (``hsx.errors``); anything
    else is a bug and surfaces as a traceback (exit 1). ``interrupted``: what to say after a
    Ctrl-C or SIGTERM, asked when it comes (what exists by then); without it a Ctrl-C is not caught.
    With it, SIGTERM (what schedulers send before a kill) stops as Ctrl-C does (``_terminate``), exit 143,
    and both wait for the end of any ``hsx.errors.uninterrupted`` block under way."""
    import signal
    import threading

    handled = interrupted is not None and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if handled else None
    # Ctrl-C where Python's own handler has it (a background job of a shell ignores it: left so)
    ctrl_c = handled and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ctrl_c:
        signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    except CleanStop as e:
        raise fail(e.lines(), e.exit_code) from None
    except DiskFull as e:
        raise fail(
            f"{e}; {e.advice[0].lower()}{e.advice[1:]} and rerun the same command: it continues", e.exit_code
        ) from None
    except HsxError as e:
        raise fail(str(e), e.exit_code) from None
    except KeyboardInterrupt as e:
        if interrupted is None:
            raise
        done = "".join(f"{note}; " for note in getattr(e, "__notes__", []))  # what the stage says is done
        if isinstance(e, Terminated):
            raise fail(f"terminated (SIGTERM); {done}{interrupted()}", Exit.TERMINATED) from None
        raise fail(f"interrupted; {done}{interrupted()}", Exit.INTERRUPTED) from None
    finally:
        if handled:
            signal.signal(signal.SIGTERM, previous)
        if ctrl_c:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _terminate(signum: int, frame) -> None:
    """SIGTERM: the clean stop of Ctrl-C (a KeyboardInterrupt in the main thread). Further SIGTERMs
    are ignored while the stop finishes its writes (a scheduler's SIGKILL still ends it)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop(Terminated())


def _interrupt(signum: int, frame) -> None:
    """Ctrl-C: Python's KeyboardInterrupt, after any ``uninterrupted`` block under way."""
    stop(KeyboardInterrupt())
