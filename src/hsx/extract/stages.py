"""The pipeline executor (``extract.executor``): ``--pipeline-parallel P`` lays the model's decoder
layers over P stages of ``--tensor-parallel T`` ranks each (``capture.stages``), under PyTorch's
elastic launcher as a tensor-parallel group is (``extract.group.run_group``).

    rank (P-1)*T   the lead: the last stage's first rank; it runs the job in its process
                   (``local.InProcess``: lock, resume, disk guard, staging, the one writer), feeds
                   each batch's token ids to the first stage and takes the states from the stage
                   before its own, with up to P+1 batches in the pipe (``stages.PipelineCapture``)
    the others     load their stage when the lead says so, then take each batch from the rank
                   before them (the first stage's from the lead), run their layers and hand the
                   residual stream and the aux states so far to the rank after them

Each rank works out the partition (``memory.Inventory.stages``) from the checkpoint's headers once
told to load (the same figures, so the same stages; the lead logs them): a resume that finds every
file in place reads no model at all. Everything after the capture is the in-process job's: the
same files, verification, resume and clean stop. A rank that dies stops the group, as in a
tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from hsx import fidelity, target
from hsx.capture import Capture, CapturedBatch
from hsx.capture.memory import Inventory, Layout, expert_form
from hsx.capture.stages import Link, PipelineCapture, StageRunner, Stages, follow
from hsx.errors import UnsupportedModel
from hsx.extract.group import OPTIONS, STOP, Leader, lead_job, receive, run_job
from hsx.extract.options import ExtractOptions
from hsx.extract.pipeline import open_backend
from hsx.extract.summary import ExtractSummary
from hsx.plan import load_plan
from hsx.spec import RunSpec


class Pipeline:
    """The executor of a pipeline of stages over this node's devices; the lead's ``Outcome`` is
    raised or returned here as if it had happened here."""

    def run(self, opts: ExtractOptions, spec: RunSpec, log: Callable[[str], None] = print) -> ExtractSummary:
        lead = (spec.parallel.pipeline - 1) * spec.parallel.tensor  # the last stage's first rank
        return run_job(opts, spec, log, _lead, _follow, lead)


def partition(spec: RunSpec, model_dir: Path, device: str) -> Stages:
    """The run's stages: its layout's pipeline over the checkpoint's layers, balanced by their cost."""
    inventory = Inventory.of(model_dir)
    if inventory is None:
        raise UnsupportedModel(f"{model_dir}: no weights to weigh its layers by, for a pipeline")
    p = spec.parallel
    layout = Layout(p.tensor, p.expert, expert_form(model_dir, device, spec.dtype), spec.dtype, pipeline=p.pipeline)
    return inventory.stages(layout)


class StageLeader(Leader):
    """The lead of a pipeline (``backends.Peers``): it tells the other ranks to load (and, where no
    batch ever went into the pipe, to stop), and its own capture is the pipe's; the batches travel
    through the pipe, not over the control channel."""

    def __init__(self, leader: Leader, log: Callable[[str], None] = print):
        super().__init__(leader.control, leader.ranks, leader.source)
        self.leader, self.log = leader, log  # ``leader``: the one its rank stops once more on the way out
        self.pipe: PipelineCapture | None = None

    def open(self, spec: RunSpec, model_dir: Path, device: str) -> Capture:
        stages = partition(spec, model_dir, device)
        self.log(f"pipeline stages: {stages}")
        backend = open_backend(spec, model_dir, device, stages)
        runner = StageRunner(backend, stages, self.source, spec.layers)
        self.pipe = PipelineCapture(runner, Link(stages, self.source, self.control, backend.device), spec.layers)
        return self.pipe

    def batch(self, ids: list[int]) -> None:
        pass  # the pipe carries it

    def agree(self, captured: CapturedBatch) -> None:
        pass  # one copy of the states exists: the last stage's

    def stop(self) -> None:
        if self.pipe is None:
            self.leader.stop()  # never loaded: the others wait for a word on the control channel
        elif not self.leader.stopped:
            self.leader.stopped = True
            self.pipe.close()  # the batches in the pipe taken, then the stop sent down it


def _lead(leader: Leader, spec: RunSpec, options: str) -> str:
    """The last stage's first rank: the in-process job with the pipe as its capture."""
    return lead_job(StageLeader(leader), spec, OPTIONS.validate_json(options))


def _follow(run: Path, model: str | None, spec: RunSpec, device: str, control, lead: int, options: str) -> None:
    """Every other rank: load its stage when told, then run each batch the pipe brings until its end."""
    kind, _ = receive(control, lead)
    if kind == STOP:
        return
    model_dir = target.model_dir_for(run, spec, model)
    stages = partition(spec, model_dir, device)
    rank = dist.get_rank()
    backend = open_backend(spec, model_dir, device, stages)
    runner = StageRunner(backend, stages, rank, spec.layers)
    checked = None
    if runner.is_last and spec.fidelity is not None:  # the lead's head is sharded with ours: we check too
        plan = load_plan(run, spec)

        def checked(ids: list[int]) -> tuple[list, list | None]:
            return [plan.input_ids(i) for i in ids], fidelity.checks_for(spec.fidelity, plan, ids)

    follow(runner, Link(stages, rank, control, backend.device), lead, checked)
