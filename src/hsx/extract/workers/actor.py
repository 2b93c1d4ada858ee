"""The Ray Data pool actor (``map_batches`` with a callable class): one row = one shard id.

It extracts in its own process (``workers.worker.ShardRunner``) or, for a tensor-parallel run,
through the group of N ranks it launches (``workers.group``). Ray is imported only here, and only
in the actor Ray creates.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from hsx import registry
from hsx.extract.outcome import Outcome
from hsx.extract.workers.worker import ShardRunner, Where, WorkerTask
from hsx.lock import Holder
from hsx.spec import load_spec


class ShardWorker:
    """Callable class for ``map_batches(batch_size=1)``: one row = one shard id. It extracts in its
    own process, or, for a tensor-parallel run, through the group it launches (workers.group)."""

    def __init__(self, task: WorkerTask):
        import ray

        ctx = ray.get_runtime_context()
        where = Where(
            node=ctx.get_node_id(),
            gpus=[str(g) for g in ray.get_gpu_ids()],
            restarted=ctx.was_current_actor_reconstructed,
        )
        run = Path(task.run)
        if not registry.driver_holds(run, registry.driver_id(Holder(**task.driver))):
            os._exit(registry.FENCED_EXIT)  # a restart after the driver died: write nothing
        spec = load_spec(run)
        if spec.parallel.ranks > 1:
            from hsx.extract.workers.group import GroupClient  # torch.distributed: only for a group

            self.runner: Callable[[int], Outcome] = GroupClient(task, where, spec)
        else:
            self.runner = ShardRunner(task, where)

    def __call__(self, batch: dict) -> dict:
        return self.runner(int(batch["shard"][0])).row()
