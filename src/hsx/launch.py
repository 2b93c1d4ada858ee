"""Ranks on this host: PyTorch's elastic launcher, configured once for every group hsx starts (a
tensor-parallel group, a pipeline, the interconnect's measurement)."""

from __future__ import annotations

from collections.abc import Callable


def local_ranks(n: int, entry: Callable, run_id: str) -> Callable:
    """``entry`` (a module-level function: it crosses to the spawned ranks by name) on ``n`` ranks of
    this host under PyTorch's elastic agent, run in the calling thread when the returned callable is
    called with ``entry``'s arguments; that call returns every rank's return value by rank. A
    failed rank fails them all (no restarts: the resume is the restart)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # a free port of this host
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    return elastic_launch(config, entry)
