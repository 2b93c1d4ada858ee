"""Which capture backend an extraction runs, by the name its spec records: ``backend(name)``.

Each backend's extraction side lives in its own module and meets one contract (``Backend``): the
final state a new run's spec records for it, and ``run(session, todo)``, which captures every
missing sample of the settled shards ``todo``, keeps the disk guard and seals each shard once its
files are durable. The table names the module, the package that must import for the backend to
run (``hsx status``'s capture line) and whether the backend takes a run's missing samples whole
(its engine schedules them, so they are handed over once verification is done) or shard by shard
beside verification. An optional backend (vLLM) is imported only when a run uses it; a build
without it refuses by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from hsx.errors import Refused
from hsx.job.space import Space
from hsx.plan import Plan
from hsx.progress import Progress
from hsx.spec import RunSpec
from hsx.store.format import FinalStateNorm
from hsx.store.scan import ShardScan

if TYPE_CHECKING:
    from hsx.capture import CapturedBatch


@dataclass(frozen=True)
class Entry:
    module: str  # its extraction side: ``final_state(model_dir, norm)``, ``run(session, todo)``
    package: str  # what must import for it to run
    whole: bool  # it schedules a run's missing samples itself: handed them all at once, once verified


BACKENDS = {
    "transformers": Entry("hsx.extract.pipeline", "transformers", whole=False),
    "vllm": Entry("hsx.extract.vllm", "vllm", whole=True),
}


@dataclass(frozen=True)
class Resources:
    """What one extracting process may use: its device, writer threads, host memory for writes, and
    on CPU torch's threads. Every process that runs the model gets it: a tensor-parallel group's
    ranks, a scale-out worker (``WorkerTask``)."""

    device: str
    writers: int = 8
    max_inflight_bytes: int = 4 << 30  # host memory for states not yet on disk (pinned staging on CUDA)
    threads: int | None = None  # CPU: torch's threads (--threads); None: the process's default


class Peers(Protocol):
    """The other ranks of a tensor-parallel group, as the writing rank sees them (extract.group)."""

    def load(self) -> None: ...  # they load their share of the model, now
    def batch(self, ids: list[int]) -> None: ...  # they capture the same batch, now
    def agree(self, captured: CapturedBatch) -> None: ...  # their capture equals ours


@dataclass
class Session:
    """What a backend's ``run`` works with: the run, its plan, where the model is now, this
    process's resources, the progress it counts into, the start's space verdict (the reserve its
    guard keeps, the forecast that scales bytes by the codec's ratio), and how the session lays
    the engine out (vLLM's own parallel sizes; a tensor-parallel group's other ranks)."""

    run: Path
    spec: RunSpec
    plan: Plan
    model_dir: Path
    resources: Resources
    progress: Progress
    space: Space
    log: Callable[[str], None] = print
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    peers: Peers | None = None


class Backend(Protocol):
    """A backend's extraction side (a module named in ``BACKENDS``)."""

    # what a new run's spec records as its final state, stored after the norm or before it (refused where it cannot)
    def final_state(self, model_dir: Path, norm: FinalStateNorm) -> str: ...
    def run(self, session: Session, todo: Iterable[ShardScan]) -> None: ...


def entry(name: str) -> Entry:
    """The table's entry for ``name``; refused by name when unknown."""
    found = BACKENDS.get(name)
    if found is None:
        raise Refused(f"unknown backend {name!r}: use {' or '.join(BACKENDS)}")
    return found


def backend(name: str) -> Backend:
    """The backend ``name``, imported; refused by name when unknown or not installed here."""
    try:
        return cast(Backend, importlib.import_module(entry(name).module))
    except ModuleNotFoundError as e:
        raise Refused(f"the {name} capture backend is not available here ({e})") from e
