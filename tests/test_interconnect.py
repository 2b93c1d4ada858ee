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
