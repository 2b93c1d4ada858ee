"""Draft-vocabulary maps from the plan: token frequencies over loss-masked tokens, no state reads.

A draft with a smaller vocabulary predicts only the K most frequent target tokens seen in the
training targets. ``d2t`` [K] int64 holds offsets (target id = draft id + d2t[draft id]) and
``t2d`` [V] bool marks the chosen target ids. Tokens are ranked by (count desc, id asc); when
fewer than K distinct tokens occur, the smallest unused ids fill the rest (what speculators does;
SpecForge does the same up to the order of ties). Files, per trainer:

    token_freq.pt, d2t-K.npy, t2d-K.npy    speculators (its data folder)
    vocab_mapping-K.pt                      SpecForge --vocab-mapping-path: {"d2t", "t2d"}
    d2t-K.pth                               Model-Optimizer data.draft_vocab_cache (int64 [K])
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hsx.errors import VocabError
from hsx.export.serialize import npy_bytes, torch_bytes
from hsx.plan import Plan, load_plan
from hsx.spec import load_spec
from hsx.store.durable import writable_folder, write_durable
from hsx.target import load_config, model_dir_for


def token_counts(plan: Plan, ids: Sequence[int] | None = None) -> np.ndarray:
    """Count of each token id over the loss-masked positions of the given samples (all by default)."""
    if ids is None:
        flat_ids, flat_mask = plan._ids_flat, plan._mask_flat
    else:
        flat_ids = np.concatenate([plan.input_ids(i) for i in ids]) if len(ids) else np.zeros(0, np.int32)
        flat_mask = np.concatenate([plan.loss_mask(i) for i in ids]) if len(ids) else np.zeros(0, np.int8)
    return np.bincount(flat_ids[flat_mask.astype(bool)].astype(np.int64))


def check_map(counts: np.ndarray, size: int, vocab_size: int) -> None:
    """Refuse a draft vocabulary of ``size`` that ``draft_map`` cannot make from ``counts``: what
    an export checks before it writes anything."""
    if not 0 < size <= vocab_size:
        raise VocabError(f"draft vocabulary size {size} must be in 1..{vocab_size} (the target's vocabulary)")
    if len(counts) > vocab_size:
        raise VocabError(f"the plan holds token id {len(counts) - 1}, outside the target vocabulary of {vocab_size}")


def draft_map(counts: np.ndarray, size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [size], t2d bool [vocab_size]) for the ``size`` most frequent tokens."""
    check_map(counts, size, vocab_size)
    seen = np.flatnonzero(counts)
    ranked = seen[np.lexsort((seen, -counts[seen]))][:size]
    chosen = set(ranked.tolist())
    fill = (i for i in range(vocab_size) if i not in chosen)
    selected = sorted(chosen | {next(fill) for _ in range(size - len(chosen))})
    sel = torch.tensor(selected, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[sel] = True
    return sel - torch.arange(size, dtype=torch.int64), t2d


def target_vocab_size(model_dir: Path) -> int:
    """The target's vocabulary size from its config: the length of t2d."""
    config = load_config(model_dir)
    if "vocab_size" not in config:
        raise VocabError(f"{model_dir}/config.json has no vocab_size: pass --target-vocab V")
    return int(config["vocab_size"])


@dataclass
class VocabResult:
    dest: Path
    size: int
    vocab_size: int
    distinct: int
    coverage: float  # share of loss-masked tokens the draft vocabulary covers
    files: list[Path]

    def lines(self) -> list[str]:
        return [
            f"vocab      {self.size} of {self.vocab_size} tokens ({self.distinct} seen), covering "
            f"{self.coverage:.2%} of loss-masked tokens",
            f"wrote      {', '.join(p.name for p in self.files)} in {self.dest}",
        ]


def write_vocab(
    run: Path, size: int, dest: Path | None = None, model: str | None = None, vocab_size: int | None = None
) -> VocabResult:
    """``hsx vocab``: count over the plan, write every trainer's form into DEST (default OUT/vocab)."""
    spec = load_spec(run)
    plan = load_plan(run, spec)
    if vocab_size is None:
        vocab_size = target_vocab_size(model_dir_for(run, spec, model))
    counts = token_counts(plan)
    d2t, t2d = draft_map(counts, size, vocab_size)
    dest = dest or run / "vocab"
    writable_folder(dest)  # under a file, onto a file, read-only: refused by name
    freq = {int(i): int(c) for i, c in enumerate(counts) if c}
    selected = (torch.arange(size) + d2t).numpy()
    covered = int(counts[selected[selected < len(counts)]].sum())
    outputs = {
        "token_freq.pt": torch_bytes(freq),
        f"d2t-{size}.npy": npy_bytes(d2t.numpy()),
        f"t2d-{size}.npy": npy_bytes(t2d.numpy()),
        f"vocab_mapping-{size}.pt": torch_bytes({"d2t": d2t, "t2d": t2d}),
        f"d2t-{size}.pth": torch_bytes(d2t),
    }
    total = int(counts.sum())
    info = {"size": size, "vocab_size": vocab_size, "distinct": len(freq), "masked_tokens": total}
    outputs["vocab.json"] = json.dumps(info | {"coverage": covered / max(total, 1)}, indent=1).encode()
    for name, data in outputs.items():
        write_durable(dest / name, data)
    return VocabResult(dest, size, vocab_size, len(freq), covered / max(total, 1), [dest / n for n in outputs])
