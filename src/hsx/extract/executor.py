"""How an extraction runs on processes: one contract (``Executor``), three executors.

    Executor.run(opts, spec, log) -> Summary    the opened run (its spec written or its drift
                                                refused) to its end, or a clean stop / refusal raised

- ``local.InProcess``: this process runs the job: the run's lock, the prologue (``job.prologue``),
  verification beside the work, the clean stop of a full disk.
- ``group.Group``: a tensor/expert-parallel group of this node's devices under PyTorch's elastic
  launcher; rank 0 runs ``InProcess`` with the other ranks as its ``backends.Peers`` (they load when
  told and compute every batch it names), and its ``Outcome`` comes back to the launcher.
- ``workers.driver.Workers``: Ray workers, each on one device or on its own group; the driver holds
  the lock and the prologue, hands out shard ids, and folds each shard's ``Outcome`` into the job's.

Whatever runs where, the work is one: a settled shard's missing samples captured batch by batch,
written, and the shard sealed (``pipeline.Extractor``: ``shard`` then ``finish``), with every gate
called before each batch (``Extractor.gates``: the disk guard; a pause of the producer would be one
more). What crosses a process is an ``outcome.Outcome`` (the tally, a clean stop with the space
still needed, or an error), serialized there alone; a full disk is said by ``job.prologue``'s
``clean_stop`` in the process holding the prologue, so every executor stops with the same words
and exit code.

A new executor (a pipeline of stages over ranks, say) implements ``run``, hands its lead the
``Peers`` its ranks need, returns its lead's ``Outcome.result()``, and is picked in ``executor_for``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hsx.errors import OptionError
from hsx.extract.folder import open_run
from hsx.extract.local import InProcess
from hsx.extract.options import ExtractOptions
from hsx.job.resume import Summary
from hsx.spec import RunSpec


class Executor(Protocol):
    def run(self, opts: ExtractOptions, spec: RunSpec, log: Callable[[str], None]) -> Summary: ...


def executor_for(spec: RunSpec) -> Executor:
    """The executor of a run on this node: a pipeline of stages, or a group where the spec lays the
    model over several ranks."""
    if spec.parallel.pipeline > 1:
        from hsx.extract.stages import Pipeline  # torch.distributed: imported only for a pipeline

        return Pipeline()
    if spec.parallel.ranks > 1:
        from hsx.extract.group import Group  # torch.distributed: imported only for a group

        return Group()
    return InProcess()


def extract(opts: ExtractOptions, log: Callable[[str], None] = print) -> Summary:
    """Extract into ``opts.out`` (a new run, or the resume of one) to the end or a clean stop.

    Raises a ``Refused`` (exit 2) when it cannot start as asked, ``CleanStop`` (exit 3) when the
    volume filled; returns the summary otherwise."""
    if opts.workers and (opts.pipeline_parallel or 1) > 1:
        raise OptionError(
            "--workers runs workers of one GPU or of a tensor-parallel group, not pipelines: "
            "omit --workers (one pipeline over this node's GPUs) or --pipeline-parallel"
        )
    if opts.workers:  # Ray first: the workers' devices decide a new run's dtype and packing
        from hsx.extract.workers.driver import workers

        with workers(opts, log) as (opts, executor):
            return executor.run(opts, open_run(opts, log), log)
    spec = open_run(opts, log)
    return executor_for(spec).run(opts, spec, log)
