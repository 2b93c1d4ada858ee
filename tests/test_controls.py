"""Held-out controls: a draft trained in its trainer's own loop on a run's real states beats the same
draft trained the same way on the run with its states shuffled (``controls``), on held-out samples.

The target is ``context_target``: its next word is a rule of the word two back, so a draft can
predict it only from the target's states at its position. A training loop that runs and logs
finite losses proves nothing about the states; this shows they are the target's, at the right
positions, and that the export hands them to the trainer so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SMALL_RUN, hsx, require, write_jsonl
from context_target import CONTEXT_TARGET, conversations
from controls import TAPS, control
from hsx.export.core import MANIFEST
from test_drafts import DFLASH_SMALL, speculators_train
from test_export import export

SAMPLES, TRAINED = 64, 48  # the last 16 are held out: speculators validates on its data's last rows
EPOCHS = 4
# one draft layer, four passes over the 48 samples at a fixed rate: the least training that
# separated for every data and training seed tried (docs/exports.md gives the measurements)
TRAINING = (*DFLASH_SMALL, "--num-layers", "1", "--epochs", str(EPOCHS), "--lr", "1e-2", "--scheduler-type", "none")
MARGIN = 0.3  # held-out accuracy, real minus shuffled: the smallest gap measured (16 seeds) was 0.60


def extract(root: Path, data_seed: int = 1) -> Path:
    """A DFlash run (3 taps, the final state after the norm) of the context target, as a user makes one."""
    data = write_jsonl(root / f"convs-{data_seed}.jsonl", conversations(SAMPLES, seed=data_seed))
    out = root / f"run-{data_seed}"
    hsx("extract", "--model", CONTEXT_TARGET, "--data", data, "--out", out, "--layers", "dflash:3", *SMALL_RUN)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return extract(tmp_path_factory.mktemp("context"))


def speculators_dflash(run: Path, dest: Path, seed: int = 0) -> float:
    """Held-out accuracy (speculators' own validation: its draft's tokens against the target's) of a
    DFlash draft that speculators' own ``main`` trained on ``run``'s export, as its train line says."""
    out = export(run, dest / "export", "--to", "speculators", "--draft", "dflash")
    rows = [s["sample_id"] for s in json.loads((dest / "export" / MANIFEST).read_text())["samples"]]
    assert rows == list(range(SAMPLES))  # its rows are the run's ids: the held-out rows are the last
    (line,) = [x.split(None, 1)[1] for x in out.splitlines() if x.startswith("train ")]
    # no step bound before the last pass ends (a step holds a sample at least)
    bounds = ("--train-data-ratio", str(TRAINED / SAMPLES), "--max-steps", str(EPOCHS * TRAINED), "--seed", str(seed))
    steps, val = speculators_train(line, dest / "save", *TRAINING, *bounds)
    assert sorted({s["epoch"] for s in steps}) == list(range(EPOCHS))
    return val["full_acc_epoch"]


def test_a_speculators_dflash_draft_learns_from_the_real_states_what_shuffled_ones_cannot_teach(run, tmp_path):
    require("speculators")
    result = control(run, tmp_path, TAPS, lambda r: speculators_dflash(r, tmp_path / r.name), range(TRAINED))
    states = [tmp_path / name / "export" / "hidden_states" for name in (run.name, f"shuffled-{TAPS}-0")]
    same = [(states[0] / f"hs_{i}.safetensors").read_bytes() == (states[1] / f"hs_{i}.safetensors").read_bytes()
            for i in range(SAMPLES)]  # fmt: skip
    assert same == [False] * TRAINED + [True] * (SAMPLES - TRAINED)  # both validated on the same real states
    result.check(MARGIN)


if __name__ == "__main__":  # the margin over seeds: python tests/test_controls.py TMP DATA_SEEDS SEEDS
    import sys

    import torch

    torch.set_num_threads(1)
    root, data_seeds, seeds = Path(sys.argv[1]), *([int(x) for x in a.split(",")] for a in sys.argv[2:4])
    for data_seed in data_seeds:
        run = extract(root, data_seed)
        for seed in seeds:
            tmp = root / f"seed-{data_seed}-{seed}"
            c = control(
                run, tmp, TAPS, lambda r, t=tmp, s=seed: speculators_dflash(r, t / r.name, s), range(TRAINED), seed
            )
            print(f"data {data_seed} seed {seed}: real {c.real:.3f} shuffled {c.shuffled:.3f}", flush=True)
