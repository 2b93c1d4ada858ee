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

The partition (``memory.Inventory.stages``) is worked out once here, from the checkpoint's headers,
logged, and handed to every rank. Everything after the capture is the in-process job's: the same
files, verification, resume and clean stop. A rank that dies stops the group, as in a
tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from pydantic import BaseModel, TypeAdapter

from hsx import interconnect, target
from hsx.capture import Capture, CapturedBatch
from hsx.capture.memory import Inventory, Layout, expert_form
from hsx.capture.stages import Link, PipelineCapture, StageRunner, Stages, follow
from hsx.errors import UnsupportedModel
from hsx.extract.group import OPTIONS, STOP, Leader, lead_job, receive, run_group
from hsx.extract.options import ExtractOptions
from hsx.extract.outcome import Outcome
from hsx.extract.pipeline import open_backend
from hsx.job.resume import Summary
from hsx.spec import RunSpec

STAGES = TypeAdapter(Stages)


class Payload(BaseModel):
    """What every rank of a pipeline is handed: the lead's options, the stages."""

    options: str
    stages: str


class Pipeline:
    """The executor of a pipeline of stages over this node's devices; the lead's ``Outcome`` is
    raised or returned here as if it had happened here."""

    def run(self, opts: ExtractOptions, spec: RunSpec, log: Callable[[str], None] = print) -> Summary:
        resources = opts.resources()
        stages = partition(spec, target.model_dir_for(opts.out, spec, opts.model), resources.device)
        interconnect.before_job(opts.out, spec.parallel.ranks, resources.device, log)
        log(f"starting {spec.parallel.ranks} ranks ({spec.parallel}) on {resources.device}; stages {stages}")
        payload = Payload(options=OPTIONS.dump_json(opts).decode(), stages=STAGES.dump_json(stages).decode())
        result = run_group(
            spec, resources, opts.out, opts.model, _lead, payload.model_dump_json(), _follow, stages.lead
        )
        return Outcome.load(result).result()


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

    def __init__(self, leader: Leader, stages: Stages):
        super().__init__(leader.control, leader.ranks, leader.source)
        self.leader, self.stages = leader, stages  # ``leader``: the one its rank stops once more on the way out
        self.pipe: PipelineCapture | None = None

    def open(self, spec: RunSpec, model_dir: Path, device: str) -> Capture:
        backend = open_backend(spec, model_dir, device, self.stages)
        runner = StageRunner(backend, self.stages, self.source, spec.layers)
        self.pipe = PipelineCapture(runner, Link(self.stages, self.source, self.control, backend.device), spec.layers)
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


def _lead(leader: Leader, spec: RunSpec, payload: str) -> str:
    """The last stage's first rank: the in-process job with the pipe as its capture."""
    given = Payload.model_validate_json(payload)
    stages = STAGES.validate_json(given.stages)
    return lead_job(StageLeader(leader, stages), spec, OPTIONS.validate_json(given.options))


def _follow(run: Path, model: str | None, spec: RunSpec, device: str, control, lead: int, payload: str) -> None:
    """Every other rank: load its stage when told, then run each batch the pipe brings until its end."""
    kind, _ = receive(control, lead)
    if kind == STOP:
        return
    stages = STAGES.validate_json(Payload.model_validate_json(payload).stages)
    rank = dist.get_rank()
    backend = open_backend(spec, target.model_dir_for(run, spec, model), device, stages)
    runner = StageRunner(backend, stages, rank, spec.layers)
    follow(runner, Link(stages, rank, control, backend.device), lead)
