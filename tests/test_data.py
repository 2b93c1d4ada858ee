"""hsx.data: the PyTorch dataset over a run, length-aware batches, rank sharding, collation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from conftest import flip_byte
from hsx.data import (
    HsxDataset,
    LengthBatchSampler,
    SamplesUnavailableWarning,
    SampleUnavailable,
    collate_packed,
    collate_padded,
    describe,
    shard_indices,
)
from hsx.plan import Plan


def sample_file(run: Path, sid: int, shard_size: int = 10) -> Path:
    return run / "shards" / f"{sid // shard_size:06d}" / f"{sid:09d}.safetensors"


def test_dataset_returns_the_files_tensors_and_the_plans_tokens(finished_run):
    ds = HsxDataset(finished_run, verify=True)
    plan = Plan(finished_run)
    assert len(ds) == 40 and ds.ids == list(range(40))
    assert ds.lengths.tolist() == plan.lengths.tolist()
    for i in (0, 17, 39):
        s = ds[i]
        raw = load_file(sample_file(finished_run, i))
        assert s["sample_id"] == i
        assert s["input_ids"].dtype == torch.int64 and s["loss_mask"].dtype == torch.int64
        assert torch.equal(s["input_ids"], torch.tensor(plan.input_ids(i), dtype=torch.int64))
        assert torch.equal(s["loss_mask"], torch.tensor(plan.loss_mask(i), dtype=torch.int64))
        assert torch.equal(s["aux_hidden_states"], raw["aux_hidden_states"])
        assert torch.equal(s["hidden_states"], raw["hidden_states"])
        assert s["aux_hidden_states"].shape == (plan.lengths[i], 3 * 64)
    info = describe(finished_run)
    assert info["hidden_size"] == 64 and info["layers"] == [1, 3, 4] and info["num_samples"] == 40


def test_only_sealed_shards_are_read_unless_asked(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "shards" / "000001" / "SEALED").unlink()  # shard 1 as if still being written
    with pytest.warns(SamplesUnavailableWarning, match=r"10 unsealed \(ids 10, 11, 12, 13, 14, \.\.\.\)"):
        ds = HsxDataset(run)
    assert ds.ids == [*range(10), *range(20, 40)]
    assert ds.unavailable == dict.fromkeys(range(10, 20), "unsealed: shard 000001 is not finished by the extraction")
    assert HsxDataset(run, sealed_only=False).ids == list(range(40))


def test_digest_check_on_read_catches_a_flipped_bit(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    flip_byte(sample_file(run, 3), -5)  # in the data: header and size still look right
    fast = HsxDataset(run, ids=[3])
    fast[0]  # the memory-mapped read does not hash
    with pytest.raises(SampleUnavailable, match=r"corrupt.*hsx extract --out"):
        HsxDataset(run, ids=[3], verify=True)[0]
    sample_file(run, 4).unlink()
    with pytest.raises(SampleUnavailable, match="missing"):
        HsxDataset(run, ids=[4])[0]
    with pytest.raises(SampleUnavailable, match="outside the plan"):
        HsxDataset(run, ids=[40])


def test_a_damaged_file_costs_only_its_own_sample_and_is_named(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    truncated = sample_file(run, 3)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    sample_file(run, 14).unlink()
    flip_byte(sample_file(run, 25), -5)  # in the data: only a digest tells
    originals = {i: sample_file(finished_run, i).read_bytes() for i in range(40)}
    intact = [
        i for i in range(40) if sample_file(run, i).is_file() and sample_file(run, i).read_bytes() == originals[i]
    ]
    assert len(intact) == 37

    with pytest.warns(SamplesUnavailableWarning, match=r"2 of 40 samples are not served.*1 missing \(id 14\)"):
        cheap = HsxDataset(run)  # header and size: the bit flip is not seen until its digest is read
    assert cheap.ids == sorted([*intact, 25])
    assert sorted(cheap.unavailable) == [3, 14]
    assert cheap.unavailable[3].startswith("truncated: shards/000000/000000003.safetensors")
    assert cheap.unavailable[14] == "missing: shards/000001/000000014.safetensors"
    with (
        pytest.warns(SamplesUnavailableWarning),
        pytest.raises(SampleUnavailable, match=r"sample 25: .*digest mismatch"),
    ):
        HsxDataset(run, verify=True)[cheap.ids.index(25)]

    with pytest.warns(SamplesUnavailableWarning, match=r"3 of 40 .*1 corrupt \(id 25\).*1 truncated \(id 3\)"):
        ds = HsxDataset(run, deep=True)
    assert ds.ids == intact and sorted(ds.unavailable) == [3, 14, 25]
    assert "digest mismatch" in ds.unavailable[25]
    served = []
    loader = DataLoader(ds, batch_sampler=LengthBatchSampler(ds.lengths, 600, shuffle=False), collate_fn=collate_padded)
    for batch in loader:
        for b, sid in enumerate(batch["sample_ids"].tolist()):
            raw = load_file(sample_file(finished_run, sid))
            n = int(batch["lengths"][b])
            assert torch.equal(batch["hidden_states"][b, :n], raw["hidden_states"])
            served.append(sid)
    assert sorted(served) == intact  # every intact sample once, and nothing else

    for deep in (False, True):
        with pytest.raises(SampleUnavailable, match=r"not served: .*strict refuses a run with any"):
            HsxDataset(run, strict=True, deep=deep)
    assert len(HsxDataset(finished_run, strict=True)) == 40


def test_length_batches_respect_the_budget_and_cover_every_index_once():
    g = torch.Generator().manual_seed(0)
    lengths = [*torch.randint(1, 300, (200,), generator=g).tolist(), 1000]
    for packed in (False, True):
        batches = LengthBatchSampler(lengths, 1024, packed).batches
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            cost = sum(lengths[i] for i in b) if packed else len(b) * max(lengths[i] for i in b)
            assert cost <= 1024 or len(b) == 1
    assert LengthBatchSampler(lengths, 1024).batches == LengthBatchSampler(lengths, 1024).batches


def test_sampler_is_deterministic_splits_ranks_evenly_and_reshuffles_per_epoch():
    lengths = [(i * 37) % 251 + 1 for i in range(300)]
    world = 3
    samplers = [LengthBatchSampler(lengths, 2048, rank=r, world_size=world, seed=7) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0])
    seen = [i for rank in per_rank for b in rank for i in b]
    assert set(seen) == set(range(300))  # every sample; repeats only from padding to equal steps
    assert len(seen) - 300 <= max(len(b) for b in samplers[0].batches) * (world - 1)
    again = LengthBatchSampler(lengths, 2048, rank=1, world_size=world, seed=7)
    assert list(again) == per_rank[1]
    again.set_epoch(1)
    assert list(again) != per_rank[1]
    dropped = [list(LengthBatchSampler(lengths, 2048, rank=r, world_size=world, drop_last=True)) for r in range(world)]
    flat = [i for rank in dropped for b in rank for i in b]
    assert len(flat) == len(set(flat))  # no repeats with drop_last
    assert sorted(i for r in range(2) for i in shard_indices(11, r, 2, seed=3)) == list(range(11))


def test_padded_and_packed_collation_through_a_dataloader(finished_run):
    ds = HsxDataset(finished_run)
    sampler = LengthBatchSampler(ds.lengths, 600, shuffle=False)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate_padded)
    total = 0
    for batch in loader:
        B, T = batch["input_ids"].shape
        assert batch["aux_hidden_states"].shape == (B, T, 192) and batch["hidden_states"].shape == (B, T, 64)
        for b, sid in enumerate(batch["sample_ids"].tolist()):
            s = ds[ds.ids.index(sid)]
            n = int(batch["lengths"][b])
            assert torch.equal(batch["input_ids"][b, :n], s["input_ids"])
            assert torch.equal(batch["hidden_states"][b, :n], s["hidden_states"])
            assert batch["attention_mask"][b].sum() == n and not batch["loss_mask"][b, n:].any()
            assert not batch["aux_hidden_states"][b, n:].any()
        total += B
    assert total == 40
    samples = [ds[i] for i in (5, 0, 9)]
    packed = collate_packed(samples)
    lens = [s["input_ids"].shape[0] for s in samples]
    assert packed["input_ids"].shape == (1, sum(lens))
    assert packed["cu_seqlens"].tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    for k, s in enumerate(samples):
        lo, hi = packed["cu_seqlens"][k], packed["cu_seqlens"][k + 1]
        assert torch.equal(packed["aux_hidden_states"][0, lo:hi], s["aux_hidden_states"])
        assert torch.equal(packed["loss_mask"][0, lo:hi], s["loss_mask"])
        assert packed["position_ids"][0, lo:hi].tolist() == list(range(lens[k]))
        assert (packed["document_ids"][0, lo:hi] == k).all()
