"""The operator's view over days: the bounded metrics history (torn lines survived), Prometheus'
text format as a textfile and over HTTP, and the pace status derives from the history."""

import itertools
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import HANG_GUARD_S
from hsx.assess import pace
from hsx.store import layout
from hsx.telemetry import GAUGES, Point, Telemetry, append_history, read_history


class Clock:
    """metrics() of a run that writes 100 tokens a beat."""

    def __init__(self):
        self.beats = 0

    def __call__(self) -> dict:
        self.beats += 1
        return {"samples_done": self.beats, "samples_total": 10**6, "tokens_done": 100 * self.beats}


def _families(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_history_stays_bounded_keeps_its_ends_and_survives_a_torn_line(tmp_path):
    metrics = Clock()
    t = Telemetry(tmp_path, lambda: metrics() | {"tokens_total": 10**8}, history_every=0, history_max=50)
    for _ in range(300):
        t.beat()
    points = read_history(tmp_path)
    assert 25 <= len(points) <= 50
    assert points[0].tokens_done == 100 and points[-1].tokens_done == 30_000  # the first and the newest
    assert all(a.time <= b.time and a.tokens_done < b.tokens_done for a, b in itertools.pairwise(points))
    recent = [p.tokens_done for p in points[-20:]]
    assert recent == list(range(28_100, 30_100, 100))  # the recent end is exact, only old lines thin
    assert json.loads((tmp_path / layout.METRICS).read_text())["tokens_done"] == 30_000

    with open(tmp_path / layout.HISTORY, "a") as f:  # a kill in the middle of an append
        f.write('{"time": 17')
    assert len(read_history(tmp_path)) == len(points)
    t.beat()
    assert read_history(tmp_path)[-1].tokens_done == 30_100 and len(read_history(tmp_path)) == len(points) + 1


def test_prometheus_textfile_and_http_endpoint_expose_the_same_figures(tmp_path):
    fixed = {"samples_done": 3, "samples_total": 9, "tokens_done": 300, "tokens_total": 900, "eta_s": None}
    prom = tmp_path / "node-exporter" / "hsx.prom"
    prom.parent.mkdir()
    with Telemetry(tmp_path, lambda: fixed, port=0, textfile=prom) as t:
        t.beat()
        from_file = _families(prom.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{t.bound_port}/metrics", timeout=HANG_GUARD_S) as r:
            served = _families(r.read().decode())
    for got in (from_file, served):
        assert got["hsx_tokens_done"] == 300 and got["hsx_samples_total"] == 9
        assert got["hsx_volume_free_bytes"] > 0
        assert "hsx_eta_seconds" not in got  # unknown is left out, not exported as 0
        assert set(got) <= {name for name, _ in GAUGES.values()}


def _point(t: float, tokens: int, free: int, total: int = 10**9) -> Point:
    return Point(time=t, samples_done=tokens // 100, tokens_done=tokens, tokens_total=total, free_bytes=free)


def test_pace_gives_the_recent_rate_the_finish_and_a_free_space_warning():
    hour = 3600.0
    # 3 hours of history; the last hour at 1,000 tok/s (the first two slower), free space falling 1 GB/h
    points = [_point(0, 0, 10 << 30), _point(hour, 100_000, 9 << 30), _point(2 * hour, 200_000, 8 << 30)]
    points += [_point(2 * hour + 60 * i, 200_000 + 60_000 * i, (8 << 30) - i * ((1 << 30) // 60)) for i in (30, 60)]
    p = pace.pace(points)
    assert p.first.time == 2 * hour + 1800 and p.seconds == 1800  # the window: the last half hour
    assert p.rate == pytest.approx(1000.0) and p.eta == pytest.approx((10**9 - 3_800_000) / 1000)
    assert p.free_fall == pytest.approx((1 << 30) / hour, rel=1e-3)
    c = pace.check(p, complete=False, now=points[-1].time + 120)
    assert c.level == "warn" and "1,000 tok/s over the 30m00s to 2m00s ago" in c.figure
    assert "runs out in 7h00m, before the run ends" in c.figure, c.figure  # 7 GB left at 1 GB/h
    enough = [q.model_copy(update={"tokens_total": 4_000_000}) for q in points]
    c = pace.check(pace.pace(enough), complete=False, now=points[-1].time)
    assert c.level == "ok" and "finish in 3m20s at that rate" in c.figure  # 200,000 left at 1,000/s
    assert pace.pace(points[:1]) is None and pace.check(None, complete=False).level == "ok"


def test_a_stalled_run_is_not_told_it_runs_out_of_space_by_others_writes():
    """The run wrote nothing for the last hour while another process filled the volume a little: no
    'runs out in 4262d' alarm (the run has no finish to race); the trend is named as others' writes."""
    hour = 3600.0
    points = [_point(0, 0, 500 << 30), _point(hour, 100_000, 499 << 30)]
    points += [
        _point(hour + 600 * i, 100_000, (499 << 30) - i * (10 << 20)) for i in (1, 6)
    ]  # 10 MiB a 10 min, others'
    p = pace.pace(points)
    assert p.rate == 0 and p.eta is None and p.runs_out is not None  # the trend alone would project an end
    c = pace.check(p, complete=False, now=points[-1].time)
    assert c.level == "ok", c.figure
    assert "no progress in that window; free space fell 62.9 MB/h from other writers" in c.figure, c.figure
    assert "runs out" not in c.figure


def test_status_shows_the_pace_from_the_history(finished_run, tmp_path):
    import shutil

    from test_status import levels, status

    run = shutil.copytree(finished_run, tmp_path / "run")
    # The extraction itself leaves one line, or two when its heartbeat beat before the end (a slow or
    # loaded machine): start this test from a run without a history, whatever the machine's speed.
    (run / "metrics-history.jsonl").unlink()
    code, text = status(run)
    assert code == 0 and "no metrics history yet" in text
    for i in range(3):
        append_history(run, _point(1000.0 + 900 * i, 50_000 * i, 10**12))
    code, text = status(run)
    assert code == 0 and levels(text)["pace"] == "ok" and "finished; 56 tok/s over the 30m00s" in text, text
