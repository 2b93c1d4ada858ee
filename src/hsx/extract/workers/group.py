"""A scale-out worker whose model replica is a tensor-parallel group (``--workers K --tensor-parallel N``).

    Ray actor (ShardWorker, N GPUs reserved)
      thread: PyTorch's elastic agent (extract.group.run_group), for as long as the actor lives
        rank 0      a ShardRunner with the other ranks as its peers: extracts the shards it is handed
        rank 1..N-1 follow rank 0 batch by batch (extract.group) and write nothing

The actor and rank 0 talk over a local socket (``multiprocessing.connection`` with a random
authkey; JSON, never pickle): the actor sends a shard id, rank 0 answers with its ``Outcome``.
A rank that dies takes its group down (the agent stops the others) and the actor with it, so Ray
restarts the actor and retries the shard on a fresh group, exactly as for a worker of one process;
when Ray ends the actor, its ranks die with it (extract.group sets PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from pathlib import Path

from pydantic import TypeAdapter

from hsx.errors import HsxError
from hsx.extract.group import Leader, run_group
from hsx.extract.outcome import Outcome
from hsx.extract.workers.worker import ShardRunner, Where, WorkerTask
from hsx.spec import RunSpec

GROUP_FAILED = 76  # the actor's exit status when its group failed: Ray restarts it


@dataclass(frozen=True)
class GroupTask:
    """What rank 0 of a worker's group needs: the worker's task, where it runs, how to call back."""

    task: WorkerTask
    where: Where
    address: str
    authkey: str  # hex


GROUP_TASK = TypeAdapter(GroupTask)


class GroupClient:
    """The actor's side: launches the group, then hands rank 0 one shard per call."""

    def __init__(self, task: WorkerTask, where: Where, spec: RunSpec):
        key = secrets.token_bytes(32)
        listener = Listener(family="AF_UNIX", authkey=key)  # a fresh socket in a private temp dir
        payload = GROUP_TASK.dump_json(GroupTask(task, where, str(listener.address), key.hex())).decode()
        self._thread = threading.Thread(
            target=self._launch, args=(task, spec, payload), name="hsx-group-agent", daemon=True
        )
        self._thread.start()
        try:
            self._conn = listener.accept()  # if the group fails first, _launch ends this process
        finally:
            listener.close()
        hello = self._receive()
        if hello.failure is not None:  # rank 0 refused (the model on this node is another, say)
            raise hello.failure.refusal()

    @staticmethod
    def _launch(task: WorkerTask, spec: RunSpec, payload: str) -> None:
        try:
            run_group(spec, task.resources, Path(task.run), task.model, serve_shards, payload)
        except Exception as e:  # a rank failed (WorkerFailed), or the group could not start at all
            print(f"hsx worker pid {os.getpid()}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            os._exit(GROUP_FAILED)  # the actor waits on rank 0's socket: only ending it ends the wait

    def _receive(self) -> Outcome:
        try:
            return Outcome.load(self._conn.recv_bytes())
        except (EOFError, OSError):  # rank 0 is gone: the agent reports the group failed, and we exit
            self._thread.join()
            os._exit(GROUP_FAILED)

    def __call__(self, shard: int) -> Outcome:
        self._conn.send_bytes(json.dumps({"shard": shard}).encode())
        return self._receive()


def serve_shards(leader: Leader, spec: RunSpec, payload: str) -> str:
    """Rank 0 of a worker's group (a ``extract.group`` lead): load, then extract each shard the actor
    sends until it hangs up."""
    job = GROUP_TASK.validate_json(payload)
    conn = Client(job.address, family="AF_UNIX", authkey=bytes.fromhex(job.authkey))
    try:
        runner = ShardRunner(job.task, job.where, peers=leader, ranks=leader.ranks)
    except HsxError as e:
        conn.send_bytes(Outcome.failed(e).dump().encode())
        return ""
    conn.send_bytes(Outcome().dump().encode())  # ready
    try:
        while True:
            try:
                shard = json.loads(conn.recv_bytes())["shard"]
            except (EOFError, OSError):
                return ""
            conn.send_bytes(runner(shard).dump().encode())
    finally:
        runner.extractor.close()
