"""The node's interconnect judged before a multi-GPU job (hsx.interconnect), on simulated readings:
this machine has no GPU, so NVML's topology and NCCL's measurement are stood in for by what the
published nodes give (8 RTX PRO 6000 on PCIe Gen5 x16: all-reduce 37.6-41.1 GB/s tuned, 22.2
untuned; a two-socket host whose ring crosses the sockets runs about 8.5 times slower), while the
judging, the job's warning, the record in the run and ``hsx status`` are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hsx import interconnect
from hsx.interconnect import PATHS, Measurement, Pair, Topology, judge

PCIE5 = 63.0  # GB/s one way: 16 lanes of Gen5


def pcie_node(sockets: int = 1) -> Topology:
    """8 GPUs, 4 a PCIe switch; with two sockets the switches hang off different CPUs."""
    between = PATHS[50] if sockets == 2 else PATHS[30]
    pairs = [Pair(a, (a + 1) % 8, False, PATHS[10] if a % 4 != 3 else between, PCIE5) for a in range(8)]
    return Topology(["NVIDIA RTX PRO 6000 Blackwell Server Edition"] * 8, pairs, "PCIe Gen5 x16")


def nvlink_node() -> Topology:
    return Topology(["NVIDIA H100 80GB HBM3"] * 8, [Pair(a, (a + 1) % 8, True, "NVLink", 450.0) for a in range(8)])


def test_a_healthy_node_passes_and_a_slow_ring_is_named_with_its_fixes():
    tuned = judge(Measurement(8, 39.0, [50.0] * 8), pcie_node())
    assert tuned.level == "ok" and tuned.slow == [] and tuned.fixes == []
    assert "no NVLink: PCIe Gen5 x16 (63 GB/s each way)" in tuned.figure()
    assert judge(Measurement(8, 361.0, [380.0] * 8), nvlink_node()).level == "ok"
    assert "NVLink (450 GB/s each way a GPU)" in judge(Measurement(8, 361.0, [380.0] * 8), nvlink_node()).figure()

    # a two-socket host whose ring crosses the sockets: all-reduce 8.5x under the tuned figure, and
    # the pairs across the sockets slow
    wrong = judge(Measurement(8, 4.6, [50.0, 50.0, 50.0, 6.0, 50.0, 50.0, 50.0, 6.0]), pcie_node(sockets=2))
    assert wrong.level == "warn"
    assert wrong.slow[0] == (
        "the all-reduce ran at 4.6 GB/s, 7% of the 63 GB/s its slowest link gives (a ring runs near its slowest link)"
    )
    assert wrong.slow[1:] == [
        "GPU 3 -> GPU 4 ran at 6.0 GB/s, 10% of the 63 GB/s of the interconnect between CPU sockets",
        "GPU 7 -> GPU 0 ran at 6.0 GB/s, 10% of the 63 GB/s of the interconnect between CPU sockets",
    ]
    assert "NCCL_P2P_LEVEL=SYS" in wrong.fixes[0] and "--pipeline-parallel" in wrong.fixes[0]
    assert any("NCCL_TOPO_FILE" in f and "NCCL_TOPO_DUMP_FILE" in f for f in wrong.fixes)
    assert any("Access Control Services" in f for f in wrong.fixes)
    # the untuned published figure (22.2 GB/s, 35% of the link) is far below too; a disabled P2P is named first
    untuned = judge(Measurement(8, 22.2, [50.0] * 8, {"NCCL_P2P_DISABLE": "1"}), pcie_node())
    assert untuned.level == "warn" and untuned.fixes[0].startswith("NCCL_P2P_DISABLE is set")
    # NVLink slowed down (a link down, P2P off): its own fixes, not PCIe's
    nv = judge(Measurement(8, 20.0, [380.0] * 8), nvlink_node())
    assert nv.level == "warn" and "nvidia-smi nvlink -s" in nv.fixes[-1]
    assert not any("ACS" in f for f in nv.fixes)
    # no NVML (no topology): figures kept, nothing judged
    assert judge(Measurement(2, 1.0, [1.0, 1.0]), None).level == "ok"


def test_a_multi_gpu_job_on_a_slow_ring_warns_before_it_starts_and_status_shows_the_record(tmp_path, monkeypatch):
    """The group's start (``extract.group``) with the measurement simulated (a two-socket ring):
    the warning and its fixes are logged before any rank starts, the figures are recorded in the
    run, and ``hsx status`` shows them as a warning without measuring again (no GPU here)."""
    import torch.distributed.launcher.api as launcher

    from hsx.assess import links
    from hsx.errors import Refused
    from hsx.extract import group
    from hsx.extract.options import ExtractOptions
    from hsx.extract.outcome import Failure, Outcome
    from hsx.spec import Parallel

    slow = Measurement(8, 4.6, [50.0, 50.0, 50.0, 6.0, 50.0, 50.0, 50.0, 6.0], {})
    measured = []
    monkeypatch.setattr(interconnect, "measure", lambda ranks, device: measured.append((ranks, device)) or slow)
    monkeypatch.setattr(interconnect, "read_topology", lambda count: pcie_node(sockets=2))
    said: list[str] = []

    def launch(config, entry):
        said.append("launched")
        return lambda *args: {0: Outcome(failure=Failure(error="Refused", message="stopped after the start")).dump()}

    monkeypatch.setattr(launcher, "elastic_launch", launch)
    out = tmp_path / "run"
    out.mkdir()
    spec = SimpleNamespace(parallel=Parallel(tensor=8, expert=8), model_dump_json=lambda: "{}")
    with pytest.raises(Refused, match="stopped after the start"):  # CPU ranks: the GPUs' measurement simulated
        group.Group().run(ExtractOptions(out=out, device="cpu"), spec, log=said.append)
    assert measured == [(8, "cpu")]
    warned = next(i for i, line in enumerate(said) if "far below what the link gives" in line)
    assert warned < said.index("launched")
    assert said[0].startswith("interconnect: 8 GPUs: all-reduce 4.6 GB/s bus bandwidth, neighbour to neighbour 6.0")
    assert any(line.startswith("  fix: the ring crosses the CPU sockets") for line in said)
    kept = interconnect.recorded(out)
    assert len(kept) == 1 and kept[0]["level"] == "warn" and kept[0]["measurement"]["allreduce_gbps"] == 4.6

    monkeypatch.setattr(interconnect, "read_topology", lambda count: None)  # status on a machine without the GPUs
    line = links.check(out, 8, busy=False)
    assert line.level == "warn" and "all-reduce 4.6 GB/s" in line.figure and "recorded" in line.figure
    assert line.action.startswith("the ring crosses the CPU sockets")
    assert measured == [(8, "cpu")]  # not measured again
    assert links.check(out, 1, busy=False).level == "ok"  # one GPU a replica: nothing to judge


def test_the_record_keeps_the_last_measurements(tmp_path):
    verdict = judge(Measurement(2, 40.0, [50.0, 50.0]), pcie_node())
    for _ in range(interconnect.KEPT + 3):
        interconnect.record(tmp_path, verdict)
    assert len(interconnect.recorded(tmp_path)) == interconnect.KEPT
    (tmp_path / "interconnect.json").write_text("{not json")
    assert interconnect.recorded(tmp_path) == []


# ---------------------------------------------------------------- sm120's known faults


class Work:
    """A collective started asynchronously, as NCCL's handle reports it: done after ``polls`` looks,
    or never (a hang)."""

    def __init__(self, polls: int | None):
        self.polls, self.seen = polls, 0

    def is_completed(self) -> bool:
        self.seen += 1
        return self.polls is not None and self.seen > self.polls


def test_a_first_allreduce_that_does_not_return_stops_the_job_with_the_p2p_advice(tmp_path, monkeypatch):
    """The bound on the first all-reduce (a simulated handle that never completes, on a clock that
    jumps), a rank's hang exit turned into the stop by ``measure``, and the group's start: stopped
    before any rank starts, with NCCL_P2P_DISABLE=1 and the topology file named, recorded as a
    failure that ``hsx status`` shows with the same fix."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from hsx import launch
    from hsx.assess import links
    from hsx.errors import InterconnectHung
    from hsx.extract import group
    from hsx.extract.options import ExtractOptions
    from hsx.spec import Parallel

    ticks = iter(range(10**6))
    clock = lambda: float(next(ticks))  # noqa: E731 - one second a look
    hang = Work(None)
    assert not interconnect.returned_within(hang, 30.0, clock) and hang.seen == 30  # then it gives up
    assert interconnect.returned_within(Work(3), 30.0, clock)

    def ranks(n, entry, run_id):
        def ran(*args):
            assert args[-1] == interconnect.FIRST_BOUND
            failed = {r: ProcessFailure(r, 1000 + r, interconnect.HANG_EXIT, "") for r in range(n)}
            raise ChildFailedError("interconnect", failed)

        return ran

    monkeypatch.setattr(launch, "local_ranks", ranks)
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    with pytest.raises(InterconnectHung) as stopped:
        interconnect.measure(8, "cuda")
    said = str(stopped.value)
    assert said.startswith(f"the first all-reduce over 8 GPUs did not return within {interconnect.FIRST_BOUND:g} s")
    assert "fix: run with NCCL_P2P_DISABLE=1: on some PCIe nodes of sm120 GPUs" in said
    assert "NCCL_TOPO_FILE" in said and "8.5x" in said

    monkeypatch.setattr(interconnect, "measure", lambda ranks, device: (_ for _ in ()).throw(stopped.value))
    monkeypatch.setattr(interconnect, "read_topology", lambda count: pcie_node())
    monkeypatch.setattr(launcher, "elastic_launch", lambda config, entry: pytest.fail("a rank was started"))
    out = tmp_path / "run"
    out.mkdir()
    spec = SimpleNamespace(parallel=Parallel(tensor=8, expert=8), model_dump_json=lambda: "{}")
    logged: list[str] = []
    with pytest.raises(InterconnectHung):
        group.Group().run(ExtractOptions(out=out, device="cpu"), spec, log=logged.append)
    assert logged[0].startswith("interconnect: the first all-reduce over 8 GPUs did not return")
    assert logged[1].startswith("  fix: run with NCCL_P2P_DISABLE=1")
    kept = interconnect.recorded(out)
    assert kept[-1]["level"] == "fail" and kept[-1]["hung"]
    monkeypatch.setattr(interconnect, "read_topology", lambda count: None)  # status, the GPUs not seen
    line = links.check(out, 8, busy=False)
    assert line.level == "fail" and "did not return" in line.figure and "recorded" in line.figure
    assert line.action.startswith("run with NCCL_P2P_DISABLE=1")
    # measured afresh by status: the same stop, as a failure
    monkeypatch.setattr(interconnect, "read_topology", lambda count: pcie_node())
    line = links.check(out, 8, busy=False)
    assert line.level == "fail" and "(measured now)" in line.figure
    assert line.action.startswith("run with NCCL_P2P_DISABLE=1") and any("NCCL_TOPO_FILE" in d for d in line.details)


def test_a_slow_ring_names_the_fix_its_nccl_settings_point_to():
    """Far under the link: with P2P disabled (the hang's workaround) that is named first, with the
    topology file as what to give NCCL; without a topology file, the file (and the 8.5x loss of
    PCIe nodes without it); with one set, a check of that file instead."""
    slow = [50.0] * 8
    disabled = judge(Measurement(8, 9.0, slow, {"NCCL_P2P_DISABLE": "1"}), pcie_node()).fixes
    assert disabled[0].startswith("NCCL_P2P_DISABLE is set: every copy goes through host memory")
    assert "(some sm120 nodes), keep it and give NCCL the host's topology (NCCL_TOPO_FILE)" in disabled[0]
    bare = judge(Measurement(8, 9.0, slow, {}), pcie_node()).fixes
    assert bare[0].startswith("NCCL may not see the real PCIe topology") and "8.5x slower without it" in bare[0]
    given = judge(Measurement(8, 9.0, slow, {"NCCL_TOPO_FILE": "/etc/nccl/topo.xml"}), pcie_node()).fixes
    assert given[0].startswith("NCCL_TOPO_FILE=/etc/nccl/topo.xml is set: check that it describes this host")
    assert not any("8.5x" in f for f in given)
