"""``hsx extract``: set up a run (plan + spec) or resume one, then capture and store what is missing.

    hsx extract --model M --data D --out OUT     new run: plan, spec, then extraction
    hsx extract --out OUT                         resume: everything comes from OUT/hsx.json

This module only dispatches: this process alone (``run.local``), a tensor-parallel group of this
node's devices (``run.group``) or Ray workers (``scaleout``).
The stages live in ``hsx.run``: options, folder (create/open, drift check), resume (verify, tidy,
settle), pipeline (capture -> staging -> writer).
"""

from __future__ import annotations

from collections.abc import Callable

from hsx.errors import CleanStop, Refused
from hsx.run.folder import open_run
from hsx.run.local import extract_local
from hsx.run.options import ExtractOptions
from hsx.run.resume import Summary

__all__ = ["CleanStop", "ExtractOptions", "Refused", "Summary", "extract"]


def extract(opts: ExtractOptions, log: Callable[[str], None] = print) -> Summary:
    """Extract into ``opts.out`` (a new run, or the resume of one) to the end or a clean stop.

    Raises a ``Refused`` (exit 2) when it cannot start as asked, ``CleanStop`` (exit 3) when the
    volume filled; returns the summary otherwise."""
    if opts.workers:
        from hsx.scaleout.driver import extract_distributed

        return extract_distributed(opts, log)
    spec = open_run(opts, log)
    if spec.parallel.ranks > 1:
        from hsx.run.group import extract_group  # torch.distributed: imported only for a group

        return extract_group(opts, spec, log)
    return extract_local(opts, log, spec)
