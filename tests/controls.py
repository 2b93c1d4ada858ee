"""The held-out control of a draft trained on hsx states: the same draft, trained the same way on the
same run with the states it reads shuffled, must do worse on held-out samples.

A draft can reach a fair accuracy from the tokens alone (the current token's usual successor), so
a training loop that runs and logs its steps proves nothing about the states. Shuffling the states
the draft reads across every token of the run keeps what they are made of (real states of this
target, the same distribution) and removes what ties them to their position. What the trainer
derives its labels from is kept as it is: the final state where its loss is the target's own
prediction (EAGLE-3, the DFlash family), the tokens for MTP. A draft on real states that beats the
shuffled one learnt from the states, and from states at the right positions.

``shuffled_run`` writes the control's run: a copy of the run, a run like any other (spec, plan,
self-verifying files, sealed shards), so that every export and trainer reads it as it reads the
real one. ``shuffle_tokens`` is the permutation, for a loop that feeds its own tensors (training
while a run is extracted). ``Control`` holds the two held-out accuracies and checks the margin.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hsx.data import read_verified
from hsx.spec import load_spec
from hsx.store import layout
from hsx.store.durable import write_parts
from hsx.store.format import SampleTensors, encode
from hsx.store.writer import FileRecord, seal

TAPS, FINAL = "aux_hidden_states", "hidden_states"  # what EAGLE-3 and DFlash drafts read; what MTP reads


def shuffle_tokens(states: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """The rows (tokens) of every tensor, [T_i, D] each, permuted across all of them together: each
    token gets another token's row, of any tensor, and the shapes stay."""
    pooled = torch.cat(states)
    moved = pooled[torch.randperm(len(pooled), generator=generator)]
    return list(moved.split([len(s) for s in states]))


def shuffled_run(run: Path, dest: Path, key: str, seed: int = 0, shuffled: range | None = None) -> Path:
    """A copy of ``run`` at ``dest`` whose ``key`` states (``TAPS`` or ``FINAL``) are shuffled across
    the tokens of the samples ``shuffled`` (all by default; ``shuffle_tokens``); every other tensor
    as it was, and the other samples whole: the held-out ones a draft is measured on stay real. Its
    files are written and sealed as the extraction writes them, without the fidelity figures (the
    states changed)."""
    spec = load_spec(run)
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("*.safetensors", "SEALED"))
    ids = range(spec.plan.num_samples)
    shuffled = ids if shuffled is None else shuffled
    samples = [read_verified(layout.sample_path(run, i, spec.shard_size), i) for i in ids]
    moved = shuffle_tokens([samples[i][key] for i in shuffled], torch.Generator().manual_seed(seed))
    for i, states in zip(shuffled, moved, strict=True):
        samples[i][key] = states
    records: dict[int, list[FileRecord]] = {}
    for i, s in zip(ids, samples, strict=True):
        aux = s.get(TAPS, s[FINAL].new_empty(len(s[FINAL]), 0))
        sample = SampleTensors(i, s["input_ids"], s["loss_mask"], aux, s[FINAL])
        parts, digest = encode(sample, spec.layers, spec.codec, spec.final_norm)
        size = write_parts(layout.sample_path(dest, i, spec.shard_size), parts)
        records.setdefault(layout.shard_of(i, spec.shard_size), []).append(FileRecord(i, size, digest))
    for shard, done in records.items():
        seal(dest, shard, done)
    return dest


@dataclass(frozen=True)
class Control:
    """Held-out accuracy of a draft trained on real states, and of the same draft trained on shuffled ones."""

    real: float
    shuffled: float

    def check(self, margin: float) -> None:
        assert self.real - self.shuffled >= margin, f"real {self.real:.3f} vs shuffled {self.shuffled:.3f}: {self}"


def control(
    run: Path, tmp: Path, key: str, train: Callable[[Path], float], shuffled: range | None = None, seed: int = 0
) -> Control:
    """``train(run)`` -> held-out accuracy, on the run and on its copy with the ``shuffled`` samples'
    ``key`` states shuffled (``shuffled_run``, made under ``tmp``)."""
    copy = shuffled_run(run, tmp / f"shuffled-{key}-{seed}", key, seed, shuffled)
    return Control(train(run), train(copy))
