"""Fidelity: the states a run captures, checked against the target's own next-token predictions.

A digest proves that a file holds the bytes hsx wrote, not that the target computed the right
numbers: a wrong kernel (an FP4 race, a bad INT4 GEMM), a wrong layer index, a missing or doubled
final norm, or states shifted against their tokens all give intact files of wrong states. The
final state, through the target's own final norm and LM head, predicts the next token; any of
those faults makes that prediction collapse. So, as each batch is captured, on the device:

- ``positions``: the tokens checked, of a sample: every ``stride``-th position whose next token is
  loss-masked (what a draft learns to predict), from an offset set by the sample id. They depend on
  the sample alone, so every process, batch and resume checks the same tokens (the figure is part
  of the file's bytes, invariant 7).
- ``measure``: per checked token, whether the argmax of the LM head on the final state is the actual
  next token (``agreed``), whether it misses it by a near tie only (the next token's logit within
  ``NEAR_TIE`` of the top one, relative: rounding, not a fault), and the next token's
  log-probability; summed per sample into a ``store.format.Figure``, which the sample's file keeps
  in its metadata and its shard's SEALED lists.
- ``Gate``: whether the run goes on, judged per batch before any of its files is written. Where
  the data is this model's own temperature-0 output (a generate run of it), agreement counting near
  ties must be at least the spec's floor (default 0.98: every token but near ties agrees); on any
  other data the first ``BASELINE`` checked tokens set the run's baseline (``fidelity.json``, beside
  the spec) and a batch below ``(1 - drop)`` of it stops the run. A batch below what is expected is
  judged on its own tokens (a collapse is caught in the batch it begins) and with the latest batches
  before it (``WINDOW`` checked tokens: a smaller fall, which one batch cannot tell from chance, is
  caught as the evidence adds up), and stops the run only where chance cannot explain the shortfall
  (``unlikely``: odds under 1 in 10^9 at the expected rate): a short batch with a stray miss never
  stops a run, while a collapse stops it within a few tokens.

``Head``: the target's final norm and LM head, from the running model (every rank of a tensor-
parallel group calls its sharded head together) or read from the checkpoint (``hsx verify
--fidelity``'s exact recomputation, and the vLLM connector). A state taken before the final norm is
normed first (``normed`` False); one after it goes straight to the head.
Logits are the head's own output: a model that caps or scales its logits after the head (Gemma 2's
softcapping, Cohere's logit scale) keeps its argmax, and its log-probability is of the uncapped logits.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel

from hsx.errors import FidelityFailed, NormUnavailable
from hsx.spec import FidelityCheck, now, read_record, who, write_record
from hsx.store import layout
from hsx.store.format import NO_FIGURE, Figure
from hsx.target import LanguageModel

if TYPE_CHECKING:
    import torch  # imported where the device work needs it: status and verify's judging never load torch

    from hsx.plan import Plan

# a miss by less than this share of the top logit's size (at least 1) is a near tie: what rounding
# in the head's dtype, or another engine's kernels, can flip; a fault misses by far more
NEAR_TIE = {"float32": 1e-3, "float16": 2**-7, "bfloat16": 2**-5}  # by the logits' dtype
WINDOW = 8192  # checked tokens a verdict weighs: the batch's own and the latest batches' before it
BASELINE = 2048  # checked tokens of a dataset run's first batches that set its baseline
LOW_BASELINE = 0.05  # a baseline under this agrees too little for a drop to be told from noise: warned
SURE = math.log(1e9)  # a verdict stops only where the agreement seen has odds under 1 in 10^9
LOGITS_BYTES = 256 << 20  # float32 logits computed at once, at most (the head runs in chunks of rows)
CAUSES = (
    "a final state taken from the wrong layer, or without (or twice through) the final norm",
    "a kernel computing wrong numbers (attention, experts, quantized GEMMs: driver, library, GPU)",
    "states shifted against their tokens (positions, packing)",
    "data that is not this model's own output (floor) or not the data the baseline was measured on",
)


def positions(sample_id: int, loss_mask: np.ndarray, stride: int) -> np.ndarray:
    """The token positions of a sample whose final state is checked: those whose next token is
    loss-masked, every ``stride``-th of them from an offset set by the sample id."""
    targets = np.flatnonzero(np.asarray(loss_mask)[1:])
    if not len(targets):
        return targets
    return targets[sample_id % min(stride, len(targets)) :: stride]


@dataclass
class Head:
    """The target's way from a final state to next-token logits: its final norm (for a state taken
    before it) and its LM head, each a function of [n, H] rows."""

    norm: Callable[[torch.Tensor], torch.Tensor]
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    vocab: int  # the logits' width

    def logits(self, final: torch.Tensor, at: torch.Tensor, normed: bool = True) -> Iterator[tuple[int, torch.Tensor]]:
        """The head's logits, in its dtype, at rows ``at`` (device int64) of ``final`` [R, T, H] seen
        as [R*T, H], in chunks of at most ``LOGITS_BYTES`` of float32: (first row, [n, vocab]).
        ``normed``: the states are after the final norm (else it is applied first). What the
        fidelity check and the stored teacher (``hsx.teacher``) both read."""
        states = final.reshape(-1, final.shape[-1]).index_select(0, at)
        if not normed:
            states = self.norm(states)
        chunk = max(1, LOGITS_BYTES // (4 * self.vocab))
        for lo in range(0, states.shape[0], chunk):
            yield lo, self.lm_head(states[lo : lo + chunk])

    @classmethod
    def of_model(cls, model, norm: torch.nn.Module) -> Head:
        """A loaded transformers model's own head (sharded over a tensor-parallel group, it gathers
        the logits: every rank calls it together) and final norm module."""
        config = model.config.get_text_config()
        divisor = float(getattr(config, "logits_mup_width_multiplier", None) or 1.0)  # finalnorm.head_divisor
        after = norm if divisor == 1.0 else (lambda x: norm(x) / divisor)
        return cls(after, model.get_output_embeddings(), int(config.vocab_size))

    @classmethod
    def of_checkpoint(cls, model_dir: Path, device: str | torch.device, dtype: torch.dtype) -> Head:
        """Read from the checkpoint alone (its final norm and LM head weights, nothing else)."""
        from hsx.finalnorm import locate as locate_norm

        lm = LanguageModel.of(model_dir)
        weight = read_weight(lm, head_name(lm)).to(device, dtype)
        return cls(locate_norm(model_dir).apply, lambda x: x @ weight.T, int(weight.shape[0]))


def head_name(lm: LanguageModel) -> str:
    """The checkpoint's LM head weight: its own, or the input embeddings where the head is tied to them."""
    names = [f"{lm.prefix}lm_head.weight"]
    if lm.config.get("tie_word_embeddings", True):  # transformers' default: a head tied to the embeddings
        names.append(f"{lm.prefix}model.embed_tokens.weight")
    found = next((n for n in names if n in lm.weights), None)
    if found is None:
        raise NormUnavailable(f"{lm.model_dir} has no LM head weight hsx can read (looked for {', '.join(names)})")
    return found


def read_weight(lm: LanguageModel, name: str) -> torch.Tensor:
    """One unquantized weight of the checkpoint, read alone (``NormUnavailable`` where it is quantized)."""
    from safetensors import safe_open

    path, entry = lm.weights[name]
    if entry.get("dtype") not in ("F32", "BF16", "F16"):
        raise NormUnavailable(f"{name} is stored as {entry.get('dtype')}: hsx reads an unquantized LM head only")
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def measure(
    head: Head,
    final: torch.Tensor,
    rows: Sequence[int],
    offsets: Sequence[int],
    sequences: Sequence[np.ndarray],
    checks: Sequence[np.ndarray],
    normed: bool = True,
    tie: float | None = None,
) -> torch.Tensor:
    """The figures of a batch, on the device: [samples, 4] float64 (checked, agreed, near ties, sum
    of log-probabilities). Sample i's states are ``final[rows[i], offsets[i] + t]``, its token ids
    ``sequences[i]``, its checked positions ``checks[i]`` (``positions``). ``normed``: the state is
    after the final norm (else the norm is applied first). ``tie``: the near-tie share (default: the
    logits' dtype's, ``NEAR_TIE``)."""
    import torch

    out = torch.zeros((len(checks), 4), dtype=torch.float64, device=final.device)
    if not sum(len(c) for c in checks):
        return out
    seg = np.repeat(np.arange(len(checks)), [len(c) for c in checks])
    at = flat_rows(rows, offsets, final.shape[1], checks)
    nxt = np.concatenate([s[c + 1] for s, c in zip(sequences, checks, strict=True)])
    index = to_device(np.stack([at, nxt, seg]), final.device)
    # each token's sample as a [samples, tokens] matrix: the sums are a product, in a fixed order
    # (index_add_ adds with atomics on CUDA, in no fixed order, and the figure is part of the file)
    owner = (index[2][None, :] == torch.arange(len(checks), device=final.device)[:, None]).double()
    for lo, logits in head.logits(final, index[0], normed):
        chunk = logits.shape[0]
        share = tie or NEAR_TIE.get(str(logits.dtype).removeprefix("torch."), NEAR_TIE["bfloat16"])
        logits = logits.float()
        top = logits.amax(-1)
        actual = logits.gather(1, index[1, lo : lo + chunk, None])[:, 0]
        agreed = actual >= top
        near = ~agreed & (top - actual <= share * top.abs().clamp(min=1.0))
        logprob = actual - torch.logsumexp(logits, -1)
        per = torch.stack([torch.ones_like(top), agreed.float(), near.float(), logprob], 1).double()
        out += owner[:, lo : lo + chunk] @ per
    return out


def flat_rows(rows: Sequence[int], offsets: Sequence[int], width: int, positions: Sequence[np.ndarray]) -> np.ndarray:
    """Each sample's ``positions`` as rows of its batch's states seen as [R*T, H] (sample i at row
    ``rows[i]``, from token ``offsets[i]``, rows ``width`` tokens long), concatenated in order."""
    parts = [r * width + o + np.asarray(p) for r, o, p in zip(rows, offsets, positions, strict=True)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def to_device(index: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 index on the device, its copy not blocking the host (pinned first on CUDA)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def figures(measured: torch.Tensor) -> list[Figure]:
    """``measure``'s rows (on the host) as figures, one per sample."""
    return [Figure(int(c), int(a), int(n), float(lp)) for c, a, n, lp in measured.tolist()]


def unlikely(seen: Figure, expected: float) -> bool:
    """Agreement ``seen`` (near ties counted) falls short of ``expected`` by more than chance explains:
    the Chernoff bound on P(at most this many of n agree | rate ``expected``), exp(-n KL(q || p)),
    is under 1 in 10^9. Zero misses of a handful stop nothing; a collapse stops within ten tokens."""
    n, p = seen.checked, expected
    if n == 0 or p <= 0:
        return False
    q = seen.matched / n
    if q >= p:
        return False
    if p >= 1:
        return True
    kl = (q * math.log(q / p) if q > 0 else 0.0) + (1 - q) * math.log((1 - q) / (1 - p))
    return n * kl > SURE


class Baseline(BaseModel):
    """``OUT/fidelity.json``: a dataset run's baseline, its first batches' figure; recorded once,
    beside the spec (measured after it was written), with when and by whom."""

    checked: int
    agreed: int
    near_ties: int
    logprob: float
    recorded: str
    by: str

    @property
    def figure(self) -> Figure:
        return Figure(self.checked, self.agreed, self.near_ties, self.logprob)

    @property
    def rate(self) -> float:
        """Agreement, near ties counted: what a later batch is held to."""
        return self.figure.matched / max(self.checked, 1)


def read_baseline(run: Path) -> Baseline | None:
    return read_record(run, run / layout.FIDELITY, Baseline)


def record_baseline(run: Path, figure: Figure) -> Baseline:
    """Record ``figure`` as the run's baseline, unless one is there already (a scale-out worker's)."""
    found = read_baseline(run)
    if found is not None:
        return found
    base = Baseline(
        checked=figure.checked,
        agreed=figure.agreed,
        near_ties=figure.near_ties,
        logprob=figure.logprob,
        recorded=now(),
        by=who(),
    )
    write_record(run, run / layout.FIDELITY, base)
    return base


def expected(check: FidelityCheck, baseline: Baseline | None) -> float | None:
    """The agreement (near ties counted) a batch must not fall short of; None while unknown."""
    if check.mode == "floor":
        return check.floor
    return None if baseline is None else baseline.rate * (1 - check.drop)


class Gate:
    """Whether the run goes on: ``judge`` takes each batch's figures before its files are written
    and raises ``FidelityFailed`` where they fall short (module docstring). ``total``: this
    session's figure."""

    def __init__(self, run: Path, check: FidelityCheck, log: Callable[[str], None] = print):
        self.run, self.check, self.log = run, check, log
        self.baseline = read_baseline(run) if check.mode == "baseline" else None
        self.first = NO_FIGURE  # a dataset run's first batches, until they set its baseline
        self.window: deque[Figure] = deque()
        self.total = NO_FIGURE

    def judge(self, ids: Sequence[int], figs: Sequence[Figure]) -> None:
        batch = sum(figs, NO_FIGURE)
        self.total += batch
        if self.check.mode == "baseline" and self.baseline is None:
            self.first += batch
            if self.first.checked >= BASELINE:
                self._set_baseline()
            return
        self.window.append(batch)
        while len(self.window) > 1 and sum(self.window, NO_FIGURE).checked - self.window[0].checked >= WINDOW:
            self.window.popleft()
        seen = sum(self.window, NO_FIGURE)
        want = expected(self.check, self.baseline)
        if want is None or batch.matched >= want * batch.checked:
            return
        if unlikely(batch, want) or unlikely(seen, want):  # a collapse by itself; a subtler fall over the window
            raise FidelityFailed(self._why(ids, figs, batch, seen, want))

    def metrics(self) -> dict:
        """This session's figure, for metrics.json (and Prometheus)."""
        t, n = self.total, max(self.total.checked, 1)
        return {
            "fidelity_checked": t.checked,
            "fidelity_agreement": t.agreed / n,
            "fidelity_near_ties": t.near_ties / n,
            "fidelity_logprob": t.logprob / n,
        }

    def _set_baseline(self) -> None:
        self.baseline = record_baseline(self.run, self.first)
        rate = self.baseline.rate
        self.log(f"fidelity: baseline {rate:.1%} agreement over the first {self.baseline.checked:,} checked tokens")
        if rate < LOW_BASELINE:
            self.log(
                f"fidelity: warning: the first batches' states predict only {rate:.1%} of the next tokens; a "
                "trained target predicts far more of text like its own, so these states may be wrong from the "
                f"start ({'; '.join(CAUSES[:3])}), and a fall from so low a baseline cannot be told from noise"
            )

    def _why(self, ids: Sequence[int], figs: Sequence[Figure], batch: Figure, seen: Figure, want: float) -> str:
        worst = sorted(zip(ids, figs, strict=True), key=lambda p: p[1].matched / max(p[1].checked, 1))[:8]
        named = ", ".join(f"{sid} ({f.matched}/{f.checked})" for sid, f in worst if f.checked)
        rule = self.check.rule(None if self.baseline is None else self.baseline.rate)
        return (
            f"fidelity: the final states of samples {_listed(ids)} predict the target's next token for "
            f"{batch.matched / batch.checked:.1%} of {batch.checked:,} checked tokens (near ties counted; "
            f"{seen.matched / seen.checked:.1%} of the latest {seen.checked:,}), where the run expects at least "
            f"{want:.1%}: {rule}. Lowest: {named}. Nothing of this batch was written. Likely causes: "
            f"{'; '.join(CAUSES)}. Find and fix the cause, then resume (hsx extract --out {self.run}; "
            "--fidelity-floor / --fidelity-drop set this session's limits)"
        )


def _listed(ids: Sequence[int], most: int = 16) -> str:
    ids = sorted(ids)
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return ", ".join(map(str, ids[:most])) + more


def checks_for(check: FidelityCheck | None, plan: Plan, ids: Sequence[int]) -> list | None:
    """The checked positions of a batch's samples, from the plan's loss masks (None: the run checks
    nothing): what every rank that checks a batch takes, so all of them check the same tokens."""
    if check is None:
        return None
    return [positions(sid, plan.loss_mask(sid), check.stride) for sid in ids]
