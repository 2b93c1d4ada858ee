"""The node's interconnect: what joins its GPUs, how fast it really moves data, and whether that is
far below what the link gives, before a multi-GPU job commits days to it.

A tensor-parallel layout all-reduces the residual stream twice or three times a layer; on GPUs
joined by PCIe that traffic, not the forward pass, sets the pace, and a wrong ring (NCCL routing
through the CPU interconnect of a two-socket host, peer-to-peer disabled, a hidden PCIe topology in
a VM) costs several times more with no error anywhere. So a multi-GPU job measures, for a few
seconds, with the job's own NCCL settings:

- the all-reduce bus bandwidth over all its GPUs (bytes x 2(n-1)/n over the time, as nccl-tests
  reports it), on 256 MB of bf16;
- the point-to-point bandwidth from each GPU to the next (each sends and receives at once);

the first all-reduce bounded (``FIRST_BOUND``): on some PCIe nodes of sm120 GPUs (RTX PRO 6000
Blackwell) NCCL hangs there, forever, unless peer-to-peer copies are disabled; one that does not
return in time stops the job with that advice (``InterconnectHung``), not a run that never
starts. It also reads from NVML what joins each neighbouring pair (NVLink, a PCIe switch, a host
bridge, the CPU, the interconnect between CPU sockets) and what that link gives one way (NVLink:
links x their version's rate; PCIe: lanes x the generation's rate). A figure under ``SLOW`` of that is named
with the known fixes. The figures are recorded in the run (``interconnect.json``, the last
``KEPT``), and ``hsx status`` shows them (measuring afresh where no extractor of the run holds the
GPUs).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hsx.store import layout
from hsx.store.durable import write_durable

SLOW = 0.4  # a measured figure under this share of what the link gives one way is far below it
FIRST_BOUND = 120.0  # seconds a rank's first all-reduce (NCCL's set-up included) may take before it is a hang
HANG_EXIT = 75  # a measuring rank's exit status when its first all-reduce did not return within the bound
KEPT = 20  # measurements a run keeps
BYTES = 256 << 20  # per all-reduce and per send: large enough for the link's rate, not its latency
SECONDS = 1.0  # per measurement (all-reduce, then point to point)
NVLINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}  # one NVLink's one-way GB/s, by version
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.877}  # one lane, one way, by generation
PATHS = {  # NVML's common ancestor of two GPUs -> what joins them
    0: "the same board",
    10: "one PCIe switch",
    20: "PCIe switches",
    30: "one PCIe host bridge",
    40: "the CPU (one NUMA node)",
    50: "the interconnect between CPU sockets",
}


@dataclass(frozen=True)
class Pair:
    """Two neighbouring GPUs (``a`` sends to ``b`` in a ring) and what joins them."""

    a: int
    b: int
    nvlink: bool
    path: str  # PATHS' words, or "NVLink"
    gbps: float  # what the link gives one way, GB/s


@dataclass(frozen=True)
class Topology:
    """What NVML says joins the GPUs: their names and each neighbouring pair."""

    names: list[str]
    pairs: list[Pair]
    pcie: str = ""  # e.g. "PCIe Gen5 x16"

    @property
    def nvlink(self) -> bool:
        return bool(self.pairs) and all(p.nvlink for p in self.pairs)

    @property
    def gbps(self) -> float:
        """The slowest neighbouring link, one way: what a ring can at best run at."""
        return min((p.gbps for p in self.pairs), default=0.0)

    def describe(self) -> str:
        if self.nvlink:
            return f"NVLink ({self.gbps:g} GB/s each way a GPU)"
        across = sorted({p.path for p in self.pairs})
        return f"no NVLink: {self.pcie or 'PCIe'} ({self.gbps:g} GB/s each way), through {', '.join(across)}"


@dataclass(frozen=True)
class Measurement:
    """Bandwidths measured over ``ranks`` GPUs, GB/s: the all-reduce's bus bandwidth, and each
    GPU's sends to the next (rank r to r + 1, the last to the first)."""

    ranks: int
    allreduce_gbps: float
    p2p_gbps: list[float]
    nccl: dict[str, str] = field(default_factory=dict)  # the NCCL_* settings it ran with


@dataclass
class Verdict:
    """The measurement judged against the topology: ok, or warn with what is slow and the fixes."""

    topology: Topology | None
    measurement: Measurement
    slow: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    when: str = ""
    host: str = ""
    hung: bool = False  # the first all-reduce did not return within FIRST_BOUND

    @property
    def level(self) -> str:
        return "fail" if self.hung else "warn" if self.slow else "ok"

    def figure(self) -> str:
        m = self.measurement
        p2p = min(m.p2p_gbps, default=0.0)
        link = f"; {self.topology.describe()}" if self.topology else ""
        return (
            f"{m.ranks} GPUs: all-reduce {m.allreduce_gbps:,.1f} GB/s bus bandwidth, "
            f"neighbour to neighbour {p2p:,.1f} GB/s at the slowest{link}"
        )

    def lines(self) -> list[str]:
        if self.hung:
            return [f"interconnect: {self.slow[0]}", *(f"  fix: {f}" for f in self.fixes)]
        out = [f"interconnect: {self.figure()}"]
        out += [f"interconnect: far below what the link gives: {s}" for s in self.slow]
        out += [f"  fix: {f}" for f in self.fixes]
        return out

    def to_json(self) -> dict:
        return {
            "when": self.when,
            "host": self.host,
            "level": self.level,
            "topology": asdict(self.topology) if self.topology else None,
            "measurement": asdict(self.measurement),
            "slow": self.slow,
            "fixes": self.fixes,
            "hung": self.hung,
        }


def judge(measurement: Measurement, topology: Topology | None) -> Verdict:
    """Each figure against what the link gives one way: under ``SLOW`` of it is named, with the
    fixes known for that kind of link. Without a topology (no NVML) nothing is judged."""
    v = Verdict(topology, measurement, when=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    v.host = socket.gethostname()
    if topology is None or not topology.pairs:
        return v
    limit = topology.gbps
    if measurement.allreduce_gbps < SLOW * limit:
        share = measurement.allreduce_gbps / limit
        v.slow.append(
            f"the all-reduce ran at {measurement.allreduce_gbps:,.1f} GB/s, {share:.0%} of the {limit:g} GB/s "
            "its slowest link gives (a ring runs near its slowest link)"
        )
    for pair, got in zip(topology.pairs, measurement.p2p_gbps, strict=False):
        if got < SLOW * pair.gbps:
            v.slow.append(
                f"GPU {pair.a} -> GPU {pair.b} ran at {got:,.1f} GB/s, {got / pair.gbps:.0%} of the {pair.gbps:g} GB/s "
                f"of {pair.path}"
            )
    if v.slow:
        v.fixes = fixes(topology, measurement.nccl)
    return v


def fixes(topology: Topology, nccl: dict[str, str]) -> list[str]:
    """The known causes of a slow ring on this kind of node, the one the settings point to first:
    peer-to-peer copies disabled (the sm120 hang's workaround: its cost, and what to try instead),
    then a PCIe topology NCCL cannot see (no ``NCCL_TOPO_FILE``: the published 8.5x prefill loss of
    such nodes), the CPU sockets, and ACS."""
    out = []
    topo = nccl.get("NCCL_TOPO_FILE")
    if nccl.get("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        out.append(
            "NCCL_P2P_DISABLE is set: every copy goes through host memory. Unset it, so that GPUs copy to each "
            "other directly; where that hangs the first all-reduce (some sm120 nodes), keep it and give NCCL "
            "the host's topology (NCCL_TOPO_FILE)"
        )
    if "NCCL_P2P_LEVEL" in nccl:
        out.append(f"NCCL_P2P_LEVEL={nccl['NCCL_P2P_LEVEL']} limits direct copies: unset it or raise it (SYS)")
    if topology.nvlink:
        out.append(
            "check the links: `nvidia-smi nvlink -s` (a link down halves a pair), and on NVSwitch systems that "
            "nvidia-fabricmanager runs"
        )
        return out
    if any(p.path == PATHS[50] for p in topology.pairs):
        out.append(
            "the ring crosses the CPU sockets: NCCL_P2P_LEVEL=SYS lets GPUs copy across them where the platform "
            "allows it; else keep tensor parallelism within a socket and lay a pipeline across "
            "(--pipeline-parallel), whose stages hand on one activation a token"
        )
    if topo:
        out.append(
            f"NCCL_TOPO_FILE={topo} is set: check that it describes this host (`nvidia-smi topo -m`); "
            "NCCL_TOPO_DUMP_FILE=FILE writes what NCCL sees"
        )
    else:
        out.append(
            "NCCL may not see the real PCIe topology (virtual machines hide it; nodes of PCIe GPUs are reported "
            "8.5x slower without it): write what it sees with NCCL_TOPO_DUMP_FILE=FILE, compare with "
            "`nvidia-smi topo -m`, and give it the host's with NCCL_TOPO_FILE"
        )
    out.append(
        "PCIe Access Control Services (ACS) on the switches send peer traffic up through the root complex: "
        "disable ACS (BIOS, or setpci), and run the IOMMU in passthrough (iommu=pt)"
    )
    return out


def hang_fixes(nccl: dict[str, str]) -> list[str]:
    """What to do when the first all-reduce does not return: the known cause first (sm120 PCIe
    nodes with peer-to-peer copies on), then the topology NCCL is given."""
    out = []
    if nccl.get("NCCL_P2P_DISABLE", "0") in ("", "0"):
        out.append(
            "run with NCCL_P2P_DISABLE=1: on some PCIe nodes of sm120 GPUs (RTX PRO 6000 Blackwell) NCCL's "
            "peer-to-peer copies hang the first all-reduce; disabled, copies go through host memory"
        )
    else:
        out.append("NCCL_P2P_DISABLE is set and it still hangs: check the GPUs' driver and NCCL_DEBUG=INFO's log")
    out.append(
        "give NCCL the host's PCIe topology with NCCL_TOPO_FILE (write what it sees with NCCL_TOPO_DUMP_FILE=FILE, "
        "compare with `nvidia-smi topo -m`): without it such nodes are reported 8.5x slower"
    )
    out.append("then resume with the same command: hsx measures the interconnect again before it starts")
    return out


def returned_within(work, bound: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Whether a collective started asynchronously (``work``: its ``is_completed``) returned within
    ``bound`` seconds, polled every 10 ms."""
    deadline = clock() + bound
    while not work.is_completed():
        if clock() >= deadline:
            return False
        time.sleep(0.01)
    return True


# ---------------------------------------------------------------- NVML: what joins the GPUs


def read_topology(count: int) -> Topology | None:
    """The first ``count`` GPUs' names and neighbouring links as NVML reports them; None where NVML
    cannot tell (no driver, no nvidia-ml-py)."""
    try:
        import pynvml as nvml

        nvml.nvmlInit()
    except Exception:
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(min(count, nvml.nvmlDeviceGetCount()))]
        names = [_text(nvml.nvmlDeviceGetName(h)) for h in handles]
        nvlink = [_nvlink_gbps(nvml, h) for h in handles]
        pcie = [_pcie(nvml, h) for h in handles]
        pairs = []
        for a in range(len(handles) if len(handles) > 2 else len(handles) - 1):
            b = (a + 1) % len(handles)
            joined = _status(nvml, handles[a], handles[b]) and nvlink[a] > 0 and nvlink[b] > 0
            if joined:
                pairs.append(Pair(a, b, True, "NVLink", min(nvlink[a], nvlink[b])))
                continue
            try:
                path = PATHS.get(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]), "PCIe")
            except nvml.NVMLError:
                path = "PCIe"
            pairs.append(Pair(a, b, False, path, min(pcie[a][2], pcie[b][2])))
        gen, width, _ = min(pcie, key=lambda p: p[2]) if pcie else (0, 0, 0.0)
        return Topology(names, pairs, f"PCIe Gen{gen} x{width}" if gen else "")
    except nvml.NVMLError:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvlink_gbps(nvml, handle) -> float:
    """A GPU's active NVLinks' one-way GB/s together (0: none)."""
    total = 0.0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            total += NVLINK_GBPS.get(int(nvml.nvmlDeviceGetNvLinkVersion(handle, link)), 25.0)
        except nvml.NVMLError:
            break
    return total


def _pcie(nvml, handle) -> tuple[int, int, float]:
    """(generation, lanes, one-way GB/s) of a GPU's PCIe link at its best (an idle link trains down)."""
    try:
        gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
        width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    except nvml.NVMLError:
        return 0, 0, 0.0
    return gen, width, round(PCIE_LANE_GBPS.get(gen, 0.0) * width, 1)


def _status(nvml, a, b) -> bool:
    """Whether NVML says the two GPUs reach each other over NVLink."""
    try:
        index = nvml.NVML_P2P_CAPS_INDEX_NVLINK
        return nvml.nvmlDeviceGetP2PStatus(a, b, index) == nvml.NVML_P2P_STATUS_OK
    except (AttributeError, nvml.NVMLError):
        return False


# ---------------------------------------------------------------- the measurement: NCCL, on the GPUs


def measure(ranks: int, device: str) -> Measurement | None:
    """The bandwidths over this node's first ``ranks`` GPUs, measured by as many processes over
    NCCL with this process's NCCL settings (a few seconds and the processes' start); None where
    there is nothing to measure (CPU ranks, or one GPU)."""
    if not device.startswith("cuda") or ranks < 2:
        return None
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hsx.errors import InterconnectHung
    from hsx.launch import local_ranks

    nccl = nccl_settings()
    try:
        allreduce, p2p = local_ranks(ranks, _rank, f"hsx-interconnect-{os.getpid()}")(BYTES, SECONDS, FIRST_BOUND)[0]
    except ChildFailedError as e:
        if not any(f.exitcode == HANG_EXIT for f in e.failures.values()):
            raise
        raise InterconnectHung(hung(ranks, FIRST_BOUND, nccl)) from None
    return Measurement(ranks, allreduce, p2p, nccl)


def nccl_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}


def hung(ranks: int, bound: float, nccl: dict[str, str]) -> str:
    """The stop message of a first all-reduce that did not return, with what to do."""
    said = f"the first all-reduce over {ranks} GPUs did not return within {bound:g} s: NCCL hangs"
    return "\n  ".join([said, *(f"fix: {f}" for f in hang_fixes(nccl))])


def _rank(nbytes: int, seconds: float, bound: float) -> tuple[float, list[float]]:
    """One GPU's part (the launcher's entry): a first all-reduce of one value, which must return
    within ``bound`` seconds (else this rank exits ``HANG_EXIT``: a hung NCCL cannot be torn down),
    then the all-reduce's bus bandwidth, then its sends to the next GPU while it receives from the
    one before; rank 0 returns every rank's figures, GB/s."""
    import torch
    import torch.distributed as dist

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    if not returned_within(dist.all_reduce(torch.ones(1, device=device), async_op=True), bound):
        print(f"rank {rank}: the first all-reduce did not return within {bound:g} s", flush=True)
        os._exit(HANG_EXIT)
    try:
        buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        inbox = torch.empty_like(buf)

        def timed(step: Callable[[], None]) -> float:
            """Seconds a step takes, over as many steps as fit ``seconds`` (two untimed first)."""
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            t0, n = time.perf_counter(), 0
            while True:
                step()
                n += 1
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                count = torch.tensor([float(elapsed < seconds)], device=device)
                dist.all_reduce(count, op=dist.ReduceOp.MIN)  # every rank stops after the same step
                if not count.item():
                    return elapsed / n

        busbw = nbytes * 2 * (world - 1) / world / timed(lambda: dist.all_reduce(buf)) / 1e9

        def exchange() -> None:
            ops = [dist.P2POp(dist.isend, buf, (rank + 1) % world), dist.P2POp(dist.irecv, inbox, (rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        mine = torch.tensor([busbw, nbytes / timed(exchange) / 1e9], device=device)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        return float(every[0][0]), [float(t[1]) for t in every]
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- what layouts are judged by


@dataclass(frozen=True)
class Links:
    """How fast a node's GPUs move data between them, GB/s: the all-reduce's bus bandwidth and one
    GPU's sends to the next; whether NVLink joins them; and where the figures come from."""

    allreduce_gbps: float
    p2p_gbps: float
    nvlink: bool
    source: str


def links(
    gpus: int, allreduce: float | None = None, p2p: float | None = None, nvlink: bool | None = None
) -> Links | None:
    """The figures to judge layouts of ``gpus`` GPUs by: as stated where both bandwidths are given,
    else measured on this node's first ``gpus`` GPUs; None where neither can be had."""
    if allreduce is not None and p2p is not None:
        return Links(allreduce, p2p, bool(nvlink), "stated")
    topology = read_topology(gpus)
    if topology is None or len(topology.names) < gpus:
        return None
    found = measure(gpus, "cuda")
    if found is None:
        return None
    return Links(found.allreduce_gbps, min(found.p2p_gbps), topology.nvlink, f"measured on {topology.names[0]}")


# ---------------------------------------------------------------- in the run


def record(run: Path, verdict: Verdict) -> None:
    """Keep the verdict in the run (``interconnect.json``: the last ``KEPT``, newest last)."""
    kept = [*recorded(run)[-(KEPT - 1) :], verdict.to_json()]
    write_durable(run / layout.INTERCONNECT, json.dumps(kept, indent=1).encode())


def recorded(run: Path) -> list[dict]:
    """The verdicts a run keeps, oldest first ([] where none, or the file is unreadable)."""
    try:
        kept = json.loads((run / layout.INTERCONNECT).read_text())
    except (OSError, ValueError):
        return []
    return kept if isinstance(kept, list) else []


def before_job(run: Path, ranks: int, device: str, log: Callable[[str], None]) -> Verdict | None:
    """A multi-GPU job's check of its node before it starts: measured, judged, logged (a warning
    named, with its fixes) and recorded in the run; None where there is nothing to measure."""
    from hsx.errors import InterconnectHung

    try:
        found = measure(ranks, device)
    except InterconnectHung as e:
        verdict = Verdict(read_topology(ranks), Measurement(ranks, 0.0, [], nccl_settings()), hung=True)
        verdict.slow, verdict.fixes = [str(e).split("\n")[0]], hang_fixes(verdict.measurement.nccl)
        verdict.when, verdict.host = dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), socket.gethostname()
        record(run, verdict)
        for line in verdict.lines():
            log(line)
        raise
    if found is None:
        return None
    verdict = judge(found, read_topology(ranks))
    for line in verdict.lines():
        log(line)
    record(run, verdict)
    return verdict
