"""How an extraction runs on processes: one contract (``Executor``), four executors.

    Executor.run(opts, spec, log) -> ExtractSummary    the opened run (its spec written, or its drift
                                                       refused) to its end; a clean stop, a refusal raised

- ``local.InProcess``: this process runs the job (``job.stage.session``: the run's lock, the
  prologue, the clean stop of a full disk) and its work, verification beside it.
- ``group.Group``: a tensor/expert-parallel group of this node's devices under PyTorch's elastic
  launcher; rank 0 runs ``InProcess`` with the other ranks as its ``backends.Peers`` (they load when
  told and compute every batch it names), and its ``Outcome`` comes back to the launcher.
- ``stages.Pipeline``: a pipeline of stages of contiguous layers (each stage over a tensor-parallel
  group) under the same launcher; the last stage's first rank runs ``InProcess`` with the pipe as its
  capture, the other ranks hand each batch on.
- ``workers.driver.Workers``: Ray workers, each on one device or on its own group; the driver runs
  the session (lock, prologue) and its work hands out shard ids and folds each shard's ``Outcome``
  into the job's.

``InProcess`` and ``Workers`` are the extraction stage (``stage.Extract``: how a run is created and
opened, what its lock checks first) each with a work of its own.

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

from hsx.extract.local import InProcess
from hsx.extract.options import ExtractOptions
from hsx.extract.summary import ExtractSummary
from hsx.job import stage
from hsx.job.model import Model
from hsx.spec import RunSpec

Log = Callable[[str], None]


class Executor(Protocol):
    def run(self, opts: ExtractOptions, spec: RunSpec, log: Log) -> ExtractSummary: ...


def executor_for(spec: RunSpec, model: Model | None = None) -> Executor:
    """The executor of a run on this node: a pipeline of stages, or a group where the spec lays the
    model over several ranks. ``model``: the job's, where it was opened here."""
    if spec.parallel.pipeline > 1:
        from hsx.extract.stages import Pipeline  # torch.distributed: imported only for a pipeline

        return Pipeline()
    if spec.parallel.ranks > 1:
        from hsx.extract.group import Group  # torch.distributed: imported only for a group

        return Group()
    return InProcess(model=model)


def extract(opts: ExtractOptions, log: Log = print) -> ExtractSummary:
    """Extract into ``opts.out`` (a new run, or the resume of one) to the end or a clean stop: the job
    (``job.stage.run``) of the extraction stage, launched on its executor.

    Raises a ``Refused`` (exit 2) when it cannot start as asked, ``CleanStop`` (exit 3) when the
    volume filled, ``Crashed`` (exit 1) on an error hsx did not expect, recorded in the run folder, the
    original exception its ``__cause__``; returns the summary otherwise."""
    return stage.run(InProcess(), opts, log, launch=_launch)


def _launch(opts: ExtractOptions, open_run: stage.Open, model: Model, log: Log) -> ExtractSummary:
    if opts.workers:  # Ray first: the workers' devices decide a new run's dtype and packing
        from hsx.extract.workers.driver import workers

        with workers(opts, log) as (opts, executor):
            return executor.run(opts, open_run(opts), log)
    spec = open_run(opts)
    return executor_for(spec, model).run(opts, spec, log)
