"""What an executor's work ended in, across a process: every kind of outcome, written as JSON and
read back, is returned or raised here exactly as it was there (the real processes: test_parallel's
and test_diskguard's full volumes, test_scaleout's and test_parallel's workers)."""

from __future__ import annotations

import pytest

from hsx.errors import CleanStop, Locked, NotEnoughSpace
from hsx.extract.outcome import Outcome, ShardRun
from hsx.extract.summary import ExtractSummary
from hsx.job.resume import Verified
from hsx.lock import this_process


def _across(outcome: Outcome) -> Outcome:
    """As a group's rank 0 hands it to its launcher, and a Ray worker to its driver."""
    back = Outcome.load(outcome.dump())
    assert Outcome.of_row(outcome.row()) == back
    return back


def test_every_outcome_crosses_a_process_and_is_raised_or_returned_as_it_was(tmp_path):
    summary = ExtractSummary(tmp_path, 40, already_done=10, written=5, redone={"corrupt": 1}, total_tokens=4000)
    summary.tokens_written, summary.bytes_written = 500, 9000
    summary.verified = Verified(files=10, bytes=123456, seconds=0.5, waited=0.1)
    assert _across(Outcome.of(lambda: summary)).result() == summary

    stop = CleanStop(summary, 2_400_000, tmp_path / "shards" / "000001", "under the reserve", "hsx extract --out X")

    def full():
        raise stop

    with pytest.raises(CleanStop) as there:
        _across(Outcome.of(full)).result()
    assert there.value.lines() == stop.lines() and there.value.summary == summary
    assert (there.value.needed_bytes, there.value.path, there.value.exit_code) == (2_400_000, stop.path, 3)
    assert "Stopped cleanly: 15/40 samples are done and verified; about 2.4 MB more" in there.value.lines()

    holder = this_process("extract")
    for refusal in (Locked(holder), NotEnoughSpace("measured on its first 8 files: not enough space")):

        def refused(e=refusal):
            raise e

        with pytest.raises(type(refusal)) as there:
            _across(Outcome.of(refused)).result()
        assert str(there.value) == str(refusal) and there.value.exit_code == 2

    shard = ShardRun(shard=3, host="node", pid=7, gpus="0,1", began=1.0, ended=2.5)
    skipped = _across(Outcome(shard=shard))  # a worker that found the run stopping
    assert skipped.summary is None and skipped.shard == shard

    with pytest.raises(ZeroDivisionError):  # a bug is no outcome: it surfaces where it happened
        Outcome.of(lambda: 1 / 0)
