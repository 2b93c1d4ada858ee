"""hsx vocab: draft-vocab maps from loss-masked plan tokens, equal to the trainers' own builders."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import hsx, require
from hsx.errors import VocabError
from hsx.export.vocab import draft_map, token_counts
from hsx.plan import Plan


def test_counts_are_over_loss_masked_tokens_only(finished_run):
    plan = Plan(finished_run)
    counts = token_counts(plan)
    expected = Counter()
    for i in range(len(plan)):
        expected.update(plan.input_ids(i)[plan.loss_mask(i) == 1].tolist())
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(expected)
    assert token_counts(plan, [3]).sum() == plan.loss_mask(3).sum() < counts.sum()


def test_map_ranks_by_count_then_id_and_fills_with_the_smallest_unused_ids():
    counts = np.array([0, 5, 0, 9, 5, 0, 0, 1])
    d2t, t2d = draft_map(counts, 3, 10)
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 4]  # 9, then the two 5s (1 before 4); 7 misses out
    assert torch.nonzero(t2d).squeeze(1).tolist() == [1, 3, 4] and t2d.shape == (10,)
    d2t, _ = draft_map(counts, 6, 10)
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 4, 7]  # 4 seen + the smallest unused: 0, 2
    with pytest.raises(VocabError):
        draft_map(counts, 11, 10)
    with pytest.raises(VocabError, match="outside the target vocabulary"):
        draft_map(counts, 3, 5)


def test_hsx_vocab_equals_the_trainers_builders_and_their_loaders_take_it(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "shards")  # no hidden state is read
    proc = hsx("vocab", run, "--size", "48")
    assert "48 of 2048 tokens" in proc.stdout
    out = run / "vocab"
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    d2t, t2d = np.load(out / "d2t-48.npy"), np.load(out / "t2d-48.npy")
    mapping = torch.load(out / "vocab_mapping-48.pt", weights_only=True)
    assert np.array_equal(mapping["d2t"].numpy(), d2t) and np.array_equal(mapping["t2d"].numpy(), t2d)
    assert np.array_equal(torch.load(out / "d2t-48.pth", weights_only=True).numpy(), d2t)
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and t2d.shape == (2048,)

    require("speculators")
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    ref_d2t, ref_t2d = build_vocab_mappings_from_distribution(freq, 48, 2048)
    assert np.array_equal(ref_d2t.numpy(), d2t) and np.array_equal(ref_t2d.numpy(), t2d)

    require("specforge")
    from specforge.data.preprocessing import process_token_dict_to_mappings

    sf_d2t, sf_t2d = process_token_dict_to_mappings(Counter(freq), 48, 2048)
    ours, theirs = np.flatnonzero(t2d), torch.nonzero(sf_t2d).squeeze(1).numpy()
    counts = np.array([freq.get(int(i), 0) for i in range(2048)])
    assert sorted(counts[ours]) == sorted(counts[theirs])  # the same choice up to the order of ties
    assert np.array_equal(np.arange(48) + sf_d2t.numpy(), theirs)

    require("modelopt")
    from types import SimpleNamespace

    from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel

    fake = SimpleNamespace(
        eagle_config=SimpleNamespace(draft_vocab_size=48, vocab_size=2048),
        eagle_module=SimpleNamespace(d2t=torch.zeros(48, dtype=torch.int64)),
    )
    HFEagleModel.load_draft_vocab_cache(fake, str(out / "d2t-48.pth"))
    assert np.array_equal(np.arange(48) + fake.eagle_module.d2t.numpy(), ours)


def test_vocab_refuses_without_a_known_vocabulary_size(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    proc = hsx("vocab", run, "--size", "8", "--model", tmp_path / "nowhere", check=False)
    assert proc.returncode == 2 and "--model" in proc.stderr
    hsx("vocab", run, "--size", "8", "--model", tmp_path / "nowhere", "--target-vocab", "4096")
    assert np.load(run / "vocab" / "t2d-8.npy").shape == (4096,)
    (tmp_path / "empty").mkdir()
    not_a_run = hsx("vocab", tmp_path / "empty", "--size", "8", check=False)
    assert not_a_run.returncode == 2 and "no run spec" in not_a_run.stderr and "Traceback" not in not_a_run.stderr
