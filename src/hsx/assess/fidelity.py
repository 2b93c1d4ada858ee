"""Are the states on disk the target's own numbers? The fidelity line of ``hsx status`` and ``hsx
verify --fidelity`` ("verified" means bytes and numbers: the integrity line says the bytes).

- ``line`` (status): the figures the files carry (``hsx.fidelity``: each sample's checked
  tokens, those the target's head predicts, near ties), read from their headers or their shard's
  SEALED manifest, so nothing is opened again: the run's agreement, its spread over samples, the
  samples whose own figure falls short of the run's floor or baseline by more than chance
  explains, and the baseline. A fail is for a person: a resume keeps files whose bytes are good.
- ``recompute`` (verify --fidelity): the slow, exact path. For an evenly spread sample of files,
  each stored final state goes through the checkpoint's own final norm and LM head (read from its
  weights; no model is loaded) on every loss-masked token, not a sample of them, and is judged by the
  same rule; the figure each file stores is compared with the same tokens' recomputation.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hsx import fidelity
from hsx.assess.checks import Check, ranges, skipped
from hsx.errors import SpecError
from hsx.genrun.spec import GenerateSpec
from hsx.spec import GENERATE, RunSpec
from hsx.store import layout
from hsx.store.format import FINAL_STATE, NO_FIGURE, Figure, decode, read_checked
from hsx.store.scan import ShardScan


def _summary(total: Figure) -> str:
    n = max(total.checked, 1)
    return (
        f"{total.agreed / n:.1%} of {total.checked:,} checked tokens predicted ({total.matched / n:.1%} "
        f"counting near ties), mean log-prob {total.logprob / n:.2f}"
    )


def _spread(figures: Iterable[Figure]) -> list[float]:
    """The 10th, 50th and 90th percentiles of the samples' agreement (near ties counted)."""
    rates = [f.matched / f.checked for f in figures if f.checked]
    return [round(float(q), 4) for q in np.percentile(rates, [10, 50, 90])] if rates else []


def line(run: Path, spec: RunSpec | GenerateSpec, scans: list[ShardScan]) -> Check:
    """The status line (module docstring)."""
    if spec.kind == GENERATE:
        return Check("fidelity", "ok", "a generate run holds token ids: no states to check")
    if spec.fidelity is None:
        return Check(
            "fidelity",
            "ok",
            "not checked: the run was made before hsx checked its states (hsx verify --fidelity recomputes it)",
        )
    try:
        base = fidelity.read_baseline(run)
    except SpecError as e:
        return Check("fidelity", "fail", str(e), action=f"move {layout.FIDELITY} aside: the next session measures it")
    figures = {sid: r.fidelity for s in scans for sid, r in s.good.items() if r.fidelity is not None}
    unchecked = sum(len(s.good) for s in scans) - len(figures)
    total = sum(figures.values(), NO_FIGURE)
    want = fidelity.expected(spec.fidelity, base)
    below = sorted(sid for sid, f in figures.items() if want is not None and fidelity.unlikely(f, want))
    spread = _spread(figures.values())
    data = {
        "mode": spec.fidelity.mode,
        "stride": spec.fidelity.stride,
        "expected": want,
        "checked": total.checked,
        "agreed": total.agreed,
        "near_ties": total.near_ties,
        "logprob_mean": total.logprob / max(total.checked, 1),
        "spread_p10_p50_p90": spread,
        "below": below,
        "unchecked_files": unchecked,
        "baseline": None if base is None else base.model_dump(),
    }
    if not figures:
        return Check("fidelity", "ok", f"no file checked yet; the run stops under {spec.fidelity.rule()}", data=data)
    figure = f"{_summary(total)}; samples {' / '.join(f'{q:.1%}' for q in spread)} (p10/p50/p90)"
    details = [f"1 in {spec.fidelity.stride} masked tokens checked; the run stops under {_rule(spec, base)}"]
    if spec.fidelity.mode == "baseline" and base is None:
        details.append(f"baseline not set yet: its first {fidelity.BASELINE:,} checked tokens set it")
    if unchecked:
        details.append(f"{unchecked:,} files carry no figure (written by a backend or hsx that did not check)")
    level, action = "ok", None
    if base is not None and base.rate < fidelity.LOW_BASELINE:
        level = "warn"
        details.append(
            f"the baseline {base.rate:.1%} is too low to tell a fall from noise, and low for a trained target "
            "on text like its own: the states may be wrong from the start"
        )
        action = "check a sample's states: hsx verify --fidelity"
    if below:
        level, action = "warn", "find what differs for them (hsx verify --fidelity recomputes their figures)"
        details.append(f"{len(below):,} samples fall short of the run's rule: {ranges(below)}")
    return Check("fidelity", level, figure, details=details, action=action, data=data)


def _rule(spec: RunSpec, base: fidelity.Baseline | None) -> str:
    return spec.fidelity.rule(None if base is None else base.rate)


def recompute(run: Path, spec: RunSpec, scans: list[ShardScan], model_dir: Path, files: int, device: str) -> Check:
    """Recompute the figures of ``files`` files, evenly spread over the good ones, from the checkpoint
    on ``device`` (float32), every masked token; fail naming each file the rule rejects."""
    import torch

    normed = spec.final_norm == "post"  # a pre-norm final state goes through the checkpoint's norm first
    if normed and not spec.final_state.startswith(FINAL_STATE):
        return skipped("fidelity", f"the run's final state is not one hsx can check ({spec.final_state})")
    stored = {sid: r.fidelity for s in scans for sid, r in sorted(s.good.items())}
    chosen = list(stored)[:: max(1, len(stored) // max(files, 1))][:files]
    head = fidelity.Head.of_checkpoint(model_dir, device, torch.float32)
    want = None if spec.fidelity is None else fidelity.expected(spec.fidelity, fidelity.read_baseline(run))
    tie = fidelity.NEAR_TIE[spec.dtype]  # the run's own: near ties as its head saw them
    total, wrong, differ = NO_FIGURE, [], []
    for sid in chosen:
        t = decode(read_checked(layout.sample_path(run, sid, spec.shard_size), sid, spec.footprint().files))
        ids, mask = t["input_ids"].numpy(), t["loss_mask"].numpy()
        final = t["hidden_states"].to(device, torch.float32)[None]
        every = fidelity.positions(sid, mask, 1)
        checks = [every] + ([fidelity.positions(sid, mask, spec.fidelity.stride)] if spec.fidelity else [])
        with torch.inference_mode():
            zeros = [0] * len(checks)
            figs = fidelity.figures(
                fidelity.measure(head, final, zeros, zeros, [ids] * len(checks), checks, normed, tie)
            )
        total += figs[0]
        if want is not None and fidelity.unlikely(figs[0], want):
            wrong.append(sid)
        kept = stored[sid]
        if kept is not None and abs(kept.agreed - figs[1].agreed) > kept.near_ties + figs[1].near_ties:
            differ.append(sid)
    data = {"files": chosen, "checked": total.checked, "agreed": total.agreed, "near_ties": total.near_ties,
            "wrong": wrong, "stored_differs": differ, "expected": want}  # fmt: skip
    figure = f"recomputed from the checkpoint for {len(chosen)} files, every masked token: {_summary(total)}"
    details = []
    if differ:
        details.append(f"stored figure differs from the recomputation beyond near ties: samples {ranges(differ)}")
    if wrong or differ:
        if wrong:
            details.append(f"states that do not predict the target's tokens as the run's rule needs: {ranges(wrong)}")
        return Check(
            "fidelity",
            "fail",
            figure,
            details=details,
            action="find the cause before training on this run; " + "; ".join(fidelity.CAUSES[:3]),
            data=data,
        )
    return Check("fidelity", "ok", figure, details=details, data=data)
