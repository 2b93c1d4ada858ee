"""``hsx extract``: set up a run (plan + spec) or resume one, then capture and store what is missing.

    hsx extract --model M --data D --out OUT     new run: plan, spec, then extraction
    hsx extract --out OUT                         resume: everything comes from OUT/hsx.json

The extraction job, stage by stage (what every job shares, lock, verification, space, the resume
prologue, lives in ``hsx.job``):

- ``options``: what the operator asked for (``ExtractOptions``), parsed once, defaults in one place;
- ``folder``: create a run (plan, rejects, spec last) or open one and refuse any drift from its spec;
- ``pipeline``: one process's capture -> staging -> writer pipeline (``Extractor``);
- ``local``: the single-process job that ties them together;
- ``group``: a tensor/expert-parallel group of this node's devices.

This module only dispatches: this process alone (``extract.local``), a tensor-parallel group
(``extract.group``) or Ray workers (``scaleout``), so it sits above all three.
"""

from __future__ import annotations

from collections.abc import Callable

from hsx.errors import CleanStop, Refused
from hsx.extract.folder import open_run
from hsx.extract.local import extract_local
from hsx.extract.options import ExtractOptions
from hsx.job.resume import Summary

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
        from hsx.extract.group import extract_group  # torch.distributed: imported only for a group

        return extract_group(opts, spec, log)
    return extract_local(opts, log, spec)
