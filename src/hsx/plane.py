"""The data plane (``hsx extract --plane mooncake://HOST:PORT``): a run's sample bytes for trainers
on nodes that share no filesystem with the producer, through a Mooncake store (docs/streaming.md).

The producer puts each sample file it wrote and verified, byte for byte, under the run's key
(``hsx/RUN/ID``, RUN the run's identity: two runs never share a key), and removes the key once the
window's consumers released the sample, exactly when the file path releases (and, with
``--delete-released``, deletes) it; so the pool holds at most what the window holds. A trainer
(``StreamDataset(plane=...)``) gets the bytes and checks them as it checks a file (its header, id,
what the run's files hold, its digest): a key not there yet is waited for, a value that does not
verify is never served. The records (leases, acknowledgements, checkpoints) stay files in a small
folder both sides share. Keys are put hard-pinned: the pool never evicts them.

The producer and the trainers mount no memory of their own (a process killed -9 takes its segment
with it): the pool is the segment of a store process that outlives them (``mooncake_client``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from hsx.drafts import bytes_per_token
from hsx.errors import BadFile, OptionError, PlaneError
from hsx.spec import RunSpec
from hsx.store import layout
from hsx.store.format import Expected, checked_bytes, read_checked
from hsx.store.records import identity

SCHEME = "mooncake"
PACKAGE = "mooncake-transfer-engine-non-cuda"
NOT_FOUND = -704  # the store's OBJECT_NOT_FOUND: a removal of a key already gone
PUT_RETRY = 60.0  # seconds a refused put is retried: a put a killed producer began blocks its key a while


@dataclass(frozen=True)
class Address:
    """Where the plane is: the store's master (``HOST:PORT``) and its metadata service (an
    ``http://`` URL, or the store's own peer handshake), from ``mooncake://HOST:PORT[?metadata=URL]``."""

    master: str
    metadata: str = "P2PHANDSHAKE"

    @classmethod
    def parse(cls, url: str) -> Address:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        query = parse_qs(parts.query)
        if parts.scheme != SCHEME or not parts.hostname or port is None or set(query) - {"metadata"}:
            raise OptionError(
                f"--plane {url}: give the store's master as {SCHEME}://HOST:PORT "
                "(and its metadata server as ?metadata=http://HOST:PORT/metadata where it runs one)"
            )
        return cls(f"{parts.hostname}:{port}", query.get("metadata", ["P2PHANDSHAKE"])[0])

    def __str__(self) -> str:
        tail = "" if self.metadata == "P2PHANDSHAKE" else f"?metadata={self.metadata}"
        return f"{SCHEME}://{self.master}{tail}"


def check_available(url: str) -> Address:
    """The address of ``url``, refused by name where the store's client does not import here."""
    address = Address.parse(url)
    try:
        _store_module()
    except ImportError as e:
        raise OptionError(f"--plane needs the Mooncake store's client: pip install {PACKAGE} ({e})") from e
    return address


def _store_module():
    os.environ.setdefault("GLOG_minloglevel", "1")  # the client's own INFO lines, one per call
    import mooncake.store

    return mooncake.store


def sample_bound(spec: RunSpec) -> int:
    """Bytes of the largest sample file the run can write (every token of its longest sample masked,
    its teacher's row at each), plus room for its header: the client's buffer must hold a whole value."""
    row = bytes_per_token(len(spec.layers), spec.model.hidden_size, spec.state_itemsize)
    if spec.teacher is not None:
        row += spec.teacher.row_bytes(spec.state_itemsize)
    return spec.max_length * row + (1 << 20)


def _local_host(master: str) -> str:
    """This machine's address as the master sees it (the interface a route to it leaves by)."""
    host = master.rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # a datagram socket's connect sends nothing: it only picks the route
        return s.getsockname()[0]


class Plane:
    """One process's client of the plane for one run: ``put``, ``get``, ``remove`` a sample's bytes
    by its id. It mounts no memory (the pool is a store process's); ``buffer``: bytes of the largest
    value it moves (``sample_bound``)."""

    def __init__(self, url: str, run: Path, buffer: int):
        self.address = check_available(url)
        run_id = identity(run)
        if run_id is None:
            raise OptionError(f"{run} holds no readable spec: the plane's keys are named for its run")
        self.prefix = f"hsx/{run_id}/"
        store = _store_module()
        self.store = store.MooncakeDistributedStore()
        rc = self.store.setup(
            _local_host(self.address.master), self.address.metadata, 0, buffer, "tcp", "", self.address.master
        )
        if rc != 0:
            raise PlaneError(f"{self.address}: the store's client did not start (code {rc}); is its master running?")
        self.pinned = store.ReplicateConfig()
        self.pinned.with_hard_pin = True  # never evicted: a key leaves only when its sample is released
        self.lock = threading.Lock()  # one call at a time through the client

    def key(self, sample_id: int) -> str:
        return f"{self.prefix}{sample_id:09d}"

    def __str__(self) -> str:
        return str(self.address)

    def put(self, sample_id: int, data: bytes) -> None:
        """Put a sample's bytes under its key (a key there already keeps its value: the same file's)."""
        deadline = time.monotonic() + PUT_RETRY
        while True:
            with self.lock:
                rc = self.store.put(self.key(sample_id), data, self.pinned)
                if rc == 0 or self.store.is_exist(self.key(sample_id)) == 1:
                    return
            if time.monotonic() > deadline:
                raise PlaneError(f"{self.address}: put of {self.key(sample_id)} refused (code {rc}); is the pool full?")
            time.sleep(0.5)

    def get(self, sample_id: int) -> bytes | None:
        """A sample's bytes, None where its key is not there."""
        with self.lock:
            data = self.store.get(self.key(sample_id))
        return data or None  # a sample file is never empty: the client's empty answer is a missing key

    def read(self, sample_id: int, expected: Expected | None) -> bytes:
        """A sample's bytes once checked as a file is (``format.checked_bytes``): ``FileNotFoundError``
        where its key is not there, ``BadFile`` where its bytes do not verify."""
        data = self.get(sample_id)
        if data is None:
            raise FileNotFoundError(f"{self.key(sample_id)} is not in {self.address}")
        return checked_bytes(data, sample_id, expected)

    def existing(self, sample_ids: set[int], chunk: int = 4096) -> set[int]:
        """Those of ``sample_ids`` whose key is there, asked a chunk at a time (a resume of a long run
        looks at every released id once)."""
        ids, found = sorted(sample_ids), set()
        for lo in range(0, len(ids), chunk):
            part = ids[lo : lo + chunk]
            with self.lock:
                answers = self.store.batch_is_exist([self.key(i) for i in part])
            if any(a < 0 for a in answers):
                raise PlaneError(f"{self.address}: the store could not say which keys it holds")
            found.update(i for i, a in zip(part, answers, strict=True) if a == 1)
        return found

    def remove(self, sample_id: int) -> None:
        """Remove a released sample's key (one already gone is fine); readers' leases do not hold it:
        every consumer that reads it released it."""
        with self.lock:
            rc = self.store.remove(self.key(sample_id), True)
        if rc not in (0, NOT_FOUND):
            raise PlaneError(f"{self.address}: removal of {self.key(sample_id)} refused (code {rc})")

    def close(self) -> None:
        with self.lock:
            self.store.close()


class Publisher:
    """The producer's side: keeps the pool equal to the run's sample files on disk that the window's
    consumers have not released. Each file is put once its name is there (a file appears whole under
    its name) and its digest verified; a released sample's key is removed. A new session first looks
    at what an earlier one left (a producer killed -9 between a file and its put, or a release and
    its removal). A file that does not verify is not put, and said once in ``log``: a trainer waits
    for it until ``hsx extract --out`` redoes it. Each of a run's producers (its Ray workers) keeps
    the whole run's pool: before putting the files new since its last look, it asks the store which
    are there already (one batched query), so a file another producer put is not read nor put again."""

    def __init__(self, run: Path, spec: RunSpec, url: str, log: Callable[[str], None]):
        self.run, self.shard_size, self.expected, self.log = run, spec.shard_size, spec.footprint().files, log
        self.plane = Plane(url, run, sample_bound(spec))
        self.put: set[int] | None = None  # ids whose key this session knows is there (None: not looked yet)
        self.damaged: set[int] = set()  # ids whose file did not verify: said once, not read again

    def sync(self, present: set[int], released: set[int]) -> None:
        """``present``: ids whose file is on disk and not released; ``released``: ids every named consumer released."""
        if self.put is None:
            for sid in sorted(self.plane.existing(released)):
                self.plane.remove(sid)
            self.put = self.plane.existing(present)
        else:  # another producer of the run (a Ray worker) may have put the new files: asked, never read again
            self.put |= self.plane.existing(present - released - self.put - self.damaged)
        for sid in sorted(self.put & released):
            self.plane.remove(sid)
            self.put.discard(sid)
        # a file that did not verify stays so for the session (only a resume redoes it): not read again
        for sid in sorted(present - released - self.put - self.damaged):
            path = layout.sample_path(self.run, sid, self.shard_size)
            try:
                data = read_checked(path, sid, self.expected)
            except FileNotFoundError:
                continue  # deleted since it was listed
            except BadFile as e:
                self.damaged.add(sid)
                self.log(f"plane: {path} is {e}, not put; hsx extract --out {self.run} redoes it")
                continue
            self.plane.put(sid, data)
            self.put.add(sid)

    def close(self) -> None:
        self.plane.close()
