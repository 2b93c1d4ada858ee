"""The Ray Data pool actor: loads the target once, then extracts whole shards, one per call.

A shard is done exactly as a resume does it, so a retried shard (its worker died mid-way) keeps its
verified samples and redoes the rest: scan the shard (digests by default), remove stray temp files,
quarantine misplaced ones, capture the missing ids with the single-process ``Extractor`` (same
batches, same bytes), wait until durable, seal. Ray is not imported at module level: only the
actor, created by Ray, needs it.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import numpy as np

from hsx import target
from hsx.assess.volume import DiskGuard
from hsx.extract import ExtractOptions, Extractor, Refused, Summary, load_plan, open_extractor, tidy
from hsx.lock import Holder
from hsx.progress import Progress
from hsx.scaleout import registry
from hsx.spec import load_spec
from hsx.store import layout
from hsx.store.durable import DiskFull
from hsx.store.scan import ShardScan, scan_shard
from hsx.store.writer import seal


def redo_shard(extractor: Extractor, shard: int, deep: bool, summary: Summary) -> ShardScan:
    """One shard start to end, as a resume does it: verify, tidy, capture what is missing, seal."""
    run, spec = extractor.run, extractor.spec
    scan = scan_shard(run, shard, layout.shard_ids(shard, spec.shard_size, spec.plan.num_samples), deep)
    tidy(run, scan.problems, summary)
    if not scan.complete:
        futures = extractor.shard(scan)
        extractor.finish(scan, futures)
    elif not scan.sealed:
        seal(run, shard, list(scan.good.values()))
    return scan


class ShardWorker:
    """Callable class for ``map_batches(batch_size=1)``: one row = one shard id."""

    def __init__(self, run: str, opts: ExtractOptions, driver: dict, reserve: int):
        import ray

        self.run = Path(run)
        self.opts = opts
        ctx = ray.get_runtime_context()
        self.beat = registry.Heartbeat(
            self.run,
            Holder(**driver),
            node=ctx.get_node_id(),
            device=opts.device or "cpu",
            gpus=[str(g) for g in ray.get_gpu_ids()],
            restarted=ctx.was_current_actor_reconstructed,
        )
        if not self.beat.driver_holds_run():  # a restart after the driver died: write nothing
            os._exit(registry.FENCED_EXIT)
        self.beat.start()
        self.spec = load_spec(self.run)
        if opts.model is not None:  # the driver checked its own copy of the model; this checks this node's
            diffs = self.spec.model.fingerprint.differences(
                target.identity(opts.model, target.resolve(opts.model)).fingerprint
            )
            if diffs:
                raise Refused(f"the model {opts.model} on {self.beat.record.host} is not the run's: {'; '.join(diffs)}")
        plan = load_plan(self.run, self.spec)
        self.progress = Progress(self.spec.plan.num_samples, self.spec.plan.num_tokens, self.spec.bytes_per_token)
        self.extractor = open_extractor(self.run, self.spec, plan, opts, self.progress, DiskGuard(self.run, reserve))
        self.beat.counters = self.progress.session
        self.broken: str | None = None  # after a full disk the writer is spent: refuse further shards
        self.beat.update(phase="idle")

    def __call__(self, batch: dict) -> dict:
        shard = int(batch["shard"][0])
        row = {
            "shard": shard,
            "host": self.beat.record.host,
            "pid": os.getpid(),
            "gpus": ",".join(self.beat.record.gpus),
            "kept": 0,
            "written": 0,
            "tokens": 0,
            "bytes": 0,
            "seconds": 0.0,
            "began": time.time(),
            "tidied": "{}",
            "error": "",
            "error_kind": "",
        }
        stop = self.broken or registry.stop_requested(self.run)
        if stop:
            row |= {"error": stop, "error_kind": "skipped", "ended": time.time()}
            return {k: np.array([v]) for k, v in row.items()}
        self.beat.update(shard=shard, shard_since=time.time(), phase="working")
        before = self.progress.session()
        summary = Summary(self.run, self.spec.plan.num_samples, self.spec.plan.num_tokens, 0)
        t0 = time.monotonic()
        try:
            scan = redo_shard(self.extractor, shard, self.opts.deep_verify, summary)
            row["kept"] = len(scan.good)
        except DiskFull as e:
            self.broken = f"the output volume filled up on {self.beat.record.host}"
            self.extractor.close()  # queued writes finish or remove their temp files
            row |= {"error": str(e), "error_kind": "disk_full"}
        except Exception as e:  # reported to the driver, which stops the run cleanly
            row |= {"error": f"{type(e).__name__}: {e}", "error_kind": "failed"}
            traceback.print_exc()
        after = self.progress.session()
        row["written"], row["tokens"], row["bytes"] = (a - b for a, b in zip(after, before, strict=True))
        row["seconds"] = time.monotonic() - t0
        row["ended"] = time.time()
        row["tidied"] = json.dumps(
            {"stray": summary.stray_removed, "quarantined": summary.quarantined, "redone": summary.redone}
        )
        done = self.beat.record.shards_done + (0 if row["error"] else 1)
        self.beat.update(shard=None, shard_since=None, phase="idle", shards_done=done)
        return {k: np.array([v]) for k, v in row.items()}
