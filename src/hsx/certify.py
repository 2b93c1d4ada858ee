"""Certification: every tap checked, not only the final state (which ``hsx.fidelity`` checks).

The taps are what a draft trains on, and a capture can get them wrong while the final state still
predicts the next token: a tap of the wrong layer, two taps swapped, a stream zeroed, one sample's
states mixed with its batch neighbour's (a packed-attention mask fault), positions shifted. Two
checks run as each batch is captured, on the device, and are judged with the fidelity figure
before any file of the batch is written (``Gate``):

- per-tap checks on every sample (``measure``): each tap's and the final state's tokens are finite
  and none is all zeros; each tap's RMS over the sample (its first token left out: attention sinks
  carry outsized states) stays within a band (``BAND`` either way) around what the run's first
  ``BAND_SAMPLES`` samples gave (``OUT/taps.json``, recorded once beside the spec). A sample's
  figures are kept in its file's metadata (``taps``), beside its fidelity figure.
- the shadow: 1 in ``every`` samples by sample id (and ids below ``first``), and one sample of
  every session's first batch (judged, not kept in its file: a fault present from a session's
  start stops it before it writes anything), are recomputed through transformers' plain path on
  the same loaded weights (the same ranks of a tensor-parallel group; a pipeline's stages): the
  sample alone, unpacked, eager attention, the decoder layers uncompiled, ``output_hidden_states``
  (the last layer's raw output and a pre-norm final state, which transformers does not return,
  from hooks of the plain path's own; a pipeline hands each stage's states on as it does a batch's).
  Each tap and the final state are compared token by token: the relative difference
  ``|captured - plain| / |plain|`` (L2 over the hidden size) must stay within ``bound``. A model
  with routed experts may differ at a few tokens (a router near-tie picks other experts under
  another kernel's rounding): at most ``NEAR_TIE_SHARE`` of a sample's tokens (at least one) may
  exceed the bound; a dense model none.

Why the bound is what it is (``bound``): the capture and the plain path compute the same function
with other kernels (packed or padded rows, sdpa or varlen or compiled against eager), so they
differ by rounding alone. A decoder layer adds to its input a few matrix products and reductions:
each result is rounded once to the dtype (unit roundoff ``u``: 2^-24 float32, 2^-8 bfloat16, 2^-11
float16) and is the sum of ``K`` products (``K``: the layer's longest reduction, the larger of the
hidden and intermediate sizes) accumulated in float32, whose rounding grows like ``2^-24 sqrt(K)``
when the order of the sum changes. Another kernel thus moves a layer's output by about
``u + 2^-24 sqrt(K)`` of its size, times a small count of such steps per layer (``PER_LAYER``:
attention, MLP, norms). The steps' errors are independent from layer to layer and add up like a
random walk: a state ``depth`` layers deep (a tap of layer k has depth k + 1; the final state, all
of them and the norm) differs by about ``PER_LAYER * (u + 2^-24 sqrt(K)) * sqrt(depth)``. Where the
linear layers quantize their inputs to e4m3 on the fly (``--quantized-compute fp8``), an input that
another kernel rounded differently by ``u`` lands in another e4m3 step (relative size up to
``E4M3_STEP``, 2^-3) with a chance of about ``u / E4M3_STEP`` and then moves by that whole step, so
a product's relative difference grows from ``u`` to about ``sqrt(u * E4M3_STEP)``, which takes
``u``'s place (bfloat16: 2^-5.5, 5.7x; the tiny FP8 DeepSeek-V3 of the CUDA tests, compiled and
packed against the plain path: 0.04 at its first layer, over bfloat16's bound of 0.031). Measured
on the bundled tiny Llama (CPU; packed, padded and eager) the largest difference of any token is
an eighth of the bound in float32 and under half of it in bfloat16. A fault differs by far more:
a neighbouring layer's residual stream, another token's state or a state that saw another
sample's tokens differs by a share of its own size (tenths, not thousandths).

The certificate (``OUT/certificate.json``, ``Certificate``) gathers what a reader needs to trust
the run: what each tap is, the final state's norm side, the convention, the shadow's samples and
their largest differences per tap, the per-tap bands, the fidelity figures, a digest over every
sample's ``input_ids`` and ``loss_mask``, hsx's version and the model's identity, under a digest
of its own and the run's identity (``store.records``). Each session writes it at its end (and at a
stop, with the failure); ``hsx verify --reference`` writes it after recomputing samples of any
run; exports carry it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel

from hsx import __version__
from hsx.errors import CertifyFailed, RecordDamaged
from hsx.spec import now, read_record, who, write_record
from hsx.store import layout, records

if TYPE_CHECKING:
    import torch  # imported where the device work needs it

UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
ACCUMULATE = 2.0**-24  # the unit roundoff of the float32 accumulators of every dtype's matrix products
E4M3_STEP = 2.0**-3  # e4m3's largest relative step between neighbouring values (3 mantissa bits)
PER_LAYER = 8  # rounding steps of one decoder layer under other kernels (module docstring)
NEAR_TIE_SHARE = 0.02  # of a MoE sample's tokens, at most (at least one), beyond the bound: router near-ties
BAND = 16.0  # a tap's RMS stays within [low / BAND, high * BAND] of the first samples' (short samples vary most)
BAND_SAMPLES = 8  # samples whose RMS sets the run's bands
FIELDS = 3  # per tap of a sample, on the device: tokens not finite, tokens all zero, sum of squares
# per tap of a recomputed sample: largest relative difference, tokens beyond the bound, tokens, the
# bound, tokens allowed beyond it, whether the file records it (1: picked by id) or it is only judged
SHADOW_FIELDS = 6
CERTIFICATE_FORMAT = "hsx-certificate/1"
CAUSES = (
    "a tap hooked on the wrong decoder layer, or taps in the wrong order",
    "the final norm missing or applied twice",
    "samples of a packed batch attending to each other (the attention's sequence bounds), or padding seen",
    "positions shifted or restarted wrongly (position ids, rotary)",
    "a kernel computing wrong numbers (attention, experts, quantized GEMMs, a compiled layer)",
)


def bound(dtype: str, depth: int, width: int, quantized: bool = False) -> float:
    """The relative difference a state ``depth`` layers deep may show under other kernels, in a
    model whose longest reduction sums ``width`` products; ``quantized``: its linear layers'
    inputs are rounded to e4m3 on the fly (module docstring)."""
    u = UNIT_ROUNDOFF[dtype]
    if quantized:
        u = math.sqrt(u * E4M3_STEP)
    per_step = u + ACCUMULATE * math.sqrt(width)
    return PER_LAYER * per_step * math.sqrt(max(depth, 1))


def tap_names(layers: Sequence[int]) -> list[str]:
    """The checked states of a sample, in order: each tap by its hsx id, then the final state."""
    return [f"layer {k}" for k in layers] + ["final"]


def depths(layers: Sequence[int], num_layers: int) -> list[int]:
    """Each checked state's depth in decoder layers (the final state: all of them and the norm)."""
    return [k + 1 for k in layers] + [num_layers + 1]


def shadowed(sample_id: int, every: int, first: int) -> bool:
    """Whether the run recomputes this sample through the plain path (``every`` 0: none)."""
    return every > 0 and sample_id >= 0 and (sample_id < first or sample_id % every == 0)


@dataclass(frozen=True)
class Shadow:
    """A sample's recomputation: per checked state, its largest relative difference, its tokens
    beyond the bound, and the bound."""

    diff: list[float]
    beyond: list[int]
    bound: list[float]
    tokens: int
    allowed: int  # tokens beyond the bound a state may have (router near-ties; 0 for a dense model)
    # picked by id, kept in the file; a session's first sample is judged only (which batch comes first
    # depends on the session, and a file's bytes may not)
    recorded: bool = True

    @property
    def failed(self) -> list[int]:
        return [i for i, b in enumerate(self.beyond) if b > self.allowed]


@dataclass(frozen=True)
class Taps:
    """A sample's per-tap figures (each tap, then the final state), as its file's metadata keeps them."""

    rms: list[float]
    zero: list[int]  # tokens whose state is all zeros
    nonfinite: list[int]  # tokens with a NaN or an infinity
    shadow: Shadow | None = None

    def text(self) -> str:
        body: dict = {"rms": [float(f"{r:.6g}") for r in self.rms], "zero": self.zero, "nonfinite": self.nonfinite}
        if self.shadow is not None and self.shadow.recorded:
            s = self.shadow
            body["shadow"] = {
                "diff": [float(f"{d:.4g}") for d in s.diff],
                "beyond": s.beyond,
                "bound": [float(f"{b:.4g}") for b in s.bound],
                "tokens": s.tokens,
                "allowed": s.allowed,
            }
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def parse(cls, text: str | None) -> Taps | None:
        if text is None:
            return None
        try:
            body = json.loads(text)
            s = body.get("shadow")
            shadow = None if s is None else Shadow(s["diff"], s["beyond"], s["bound"], s["tokens"], s["allowed"])
            return cls(body["rms"], body["zero"], body["nonfinite"], shadow)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a sample's tap figures: {text!r}") from e


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """An index to the device without stopping the host (from pinned memory, as ``fidelity.measure``'s)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _norms(t: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.linalg.vector_norm(t, dim=-1, dtype=torch.float32)


def measure(
    aux: torch.Tensor, final: torch.Tensor, rows: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
) -> torch.Tensor:
    """The per-tap figures of a batch, on the device: [samples, taps + 1, FIELDS] float64 (tokens not
    finite, tokens all zero, and the sum of squared token norms over tokens 1.. of the sample; its
    only token where it has one). ``aux`` [R, T, L*H], ``final`` [R, T, H]; sample i at row
    ``rows[i]``, tokens ``offsets[i] : offsets[i] + lengths[i]``."""
    import torch

    hidden = final.shape[-1]
    taps = aux.shape[-1] // hidden if hidden else 0
    # per token and state: its L2 norm (a NaN or infinity anywhere makes it not finite; all zeros make it 0)
    norms = torch.stack([_norms(aux[..., k * hidden : (k + 1) * hidden]) for k in range(taps)] + [_norms(final)], -1)
    at = np.concatenate([r * final.shape[1] + o + np.arange(n) for r, o, n in zip(rows, offsets, lengths, strict=True)])
    first = np.concatenate([np.arange(n) == 0 if n > 1 else np.zeros(n, bool) for n in lengths])
    index = _to_device(np.stack([at, first]), final.device)
    tok = norms.reshape(-1, taps + 1).index_select(0, index[0]).double()  # [tokens, taps + 1]
    finite = torch.isfinite(tok)
    squares = torch.where(finite & (index[1] == 0)[:, None], tok.square(), torch.zeros_like(tok))
    per = torch.stack([(~finite).double(), (tok == 0).double(), squares], -1)  # [tokens, taps + 1, FIELDS]
    # per sample: a difference of prefix sums at its bounds (a fixed order: the figure is in the file)
    ends = _to_device(np.cumsum(lengths), final.device)
    summed = torch.cat([torch.zeros_like(per[:1]), per.cumsum(0)]).index_select(0, torch.cat([ends.new_zeros(1), ends]))
    return summed[1:] - summed[:-1]


def figures(checked: np.ndarray, lengths: Sequence[int], hidden: int) -> list[Taps]:
    """A batch's tap figures (on the host: ``measure``'s fields, then ``compare``'s or -1 where the
    sample was not recomputed) as each sample's ``Taps``."""
    out = []
    for m, n in zip(checked, lengths, strict=True):
        counted = max(n - 1, 1) * hidden
        rms = [math.sqrt(s / counted) for s in m[:, 2]]
        sh = m[:, FIELDS:]
        shadow = None
        if sh[0, 2] >= 0:
            beyond = sh[:, 1].astype(int).tolist()
            kept = bool(sh[0, 5])
            shadow = Shadow(sh[:, 0].tolist(), beyond, sh[:, 3].tolist(), int(sh[0, 2]), int(sh[0, 4]), kept)
        out.append(Taps(rms, m[:, 1].astype(int).tolist(), m[:, 0].astype(int).tolist(), shadow))
    return out


def compare(
    captured: Sequence[torch.Tensor],
    plain: Sequence[torch.Tensor],
    bounds: Sequence[float],
    routed: bool,
    recorded: bool,
) -> torch.Tensor:
    """Per checked state, on the device: [states, SHADOW_FIELDS]. Each state [n, H], captured
    against the plain path's; ``routed``: the model has routed experts (``allowed``);
    ``recorded``: the sample's file keeps the figures (``Shadow.recorded``)."""
    import torch

    rows = []
    for got, want, b in zip(captured, plain, bounds, strict=True):
        diff = _norms(got.float() - want.float()) / _norms(want).clamp(min=torch.finfo(torch.float32).tiny)
        diff = torch.nan_to_num(diff, nan=math.inf).double()
        n = len(diff)
        fixed = diff.new_tensor([n, b, allowed(n, routed), recorded])
        rows.append(torch.cat([diff.max()[None], (diff > b).sum()[None].double(), fixed]))
    return torch.stack(rows)


def allowed(tokens: int, routed: bool) -> int:
    """Tokens of a sample that may exceed the bound: router near-ties in a model with routed experts."""
    return max(1, int(NEAR_TIE_SHARE * tokens)) if routed else 0


class Bands(BaseModel):
    """``OUT/taps.json``: each checked state's RMS band, set by the run's first samples; recorded
    once, beside the spec, with when and by whom."""

    names: list[str]
    low: list[float]  # the first samples' smallest RMS per state, divided by BAND
    high: list[float]  # their largest, times BAND
    samples: int
    recorded: str
    by: str

    def outside(self, taps: Taps) -> list[int]:
        return [i for i, (r, lo, hi) in enumerate(zip(taps.rms, self.low, self.high, strict=True)) if not lo <= r <= hi]


def read_bands(run: Path) -> Bands | None:
    return read_record(run, run / layout.TAP_BANDS, Bands)


def record_bands(run: Path, names: list[str], first: Sequence[Taps]) -> Bands:
    """Record the bands the first samples set, unless a band is there already (a scale-out worker's)."""
    found = read_bands(run)
    if found is not None:
        return found
    rms = np.array([t.rms for t in first])
    bands = Bands(
        names=names,
        low=(rms.min(0) / BAND).tolist(),
        high=(rms.max(0) * BAND).tolist(),
        samples=len(first),
        recorded=now(),
        by=who(),
    )
    write_record(run, run / layout.TAP_BANDS, bands)
    return bands


class Gate:
    """Whether the run goes on as far as its taps say: ``judge`` takes each batch's tap figures
    before its files are written and raises ``CertifyFailed`` naming the sample, the state, the
    figure and the likely causes."""

    def __init__(self, run: Path, names: list[str], log: Callable[[str], None] = print):
        self.run, self.names, self.log = run, names, log
        self.bands = read_bands(run)
        self.first: list[Taps] = []  # the first samples, until they set the bands

    def judge(self, ids: Sequence[int], taps: Sequence[Taps]) -> None:
        for sid, t in zip(ids, taps, strict=True):
            self._judge_one(sid, t)
        if self.bands is None:
            self.first += taps
            if len(self.first) >= BAND_SAMPLES:
                self.bands = record_bands(self.run, self.names, self.first)
                self.log(f"taps: RMS bands set by the first {self.bands.samples} samples")

    def _judge_one(self, sid: int, t: Taps) -> None:
        for i, name in enumerate(self.names):
            if t.nonfinite[i]:
                self._fail(sid, name, f"{t.nonfinite[i]} of its tokens are not finite (NaN or infinity)")
            if t.zero[i]:
                self._fail(sid, name, f"{t.zero[i]} of its tokens are all zeros")
        if self.bands is not None:
            for i in self.bands.outside(t):
                lo, hi = self.bands.low[i], self.bands.high[i]
                self._fail(sid, self.names[i], f"its RMS {t.rms[i]:.4g} is outside the run's band [{lo:.4g}, {hi:.4g}]")
        if t.shadow is not None:
            s = t.shadow
            for i in s.failed:
                self._fail(
                    sid,
                    self.names[i],
                    f"it differs from transformers' plain recomputation of the sample by up to {s.diff[i]:.3g} "
                    f"(relative), {s.beyond[i]} of {s.tokens} tokens beyond the bound {s.bound[i]:.3g}",
                )

    def _fail(self, sid: int, name: str, what: str) -> None:
        raise CertifyFailed(
            f"taps: sample {sid}, {name}: {what}. Nothing of this batch was written. Likely causes: "
            f"{'; '.join(CAUSES)}. Find and fix the cause, then resume (hsx extract --out {self.run})"
        )


class TapInfo(BaseModel):
    """What one checked state of the run is: its name, hsx layer id, and the module it comes from."""

    name: str
    layer: int | None  # hsx layer id; None for the final state
    what: str


class Recomputed(BaseModel):
    """Samples recomputed through the plain path and compared tap by tap: by the run as it
    extracted (``shadow``) or by ``hsx verify --reference`` after it (``reference``)."""

    samples: list[int]
    diff: list[float]  # per checked state, the largest relative difference over the samples
    bound: list[float]
    beyond: list[int]  # per checked state, tokens beyond the bound over the samples
    failed: list[int]  # samples with a state beyond what the bound and near ties allow
    every: int | None = None  # the run's rule (the shadow's)
    first: int | None = None
    device: str | None = None  # where verify recomputed
    recorded: str | None = None

    @classmethod
    def of(cls, shadows: dict[int, Shadow], **kw) -> Recomputed:
        ids = sorted(shadows)
        per = [shadows[i] for i in ids]
        width = len(per[0].diff) if per else 0
        return cls(
            samples=ids,
            diff=[max(s.diff[t] for s in per) for t in range(width)],
            bound=[min(s.bound[t] for s in per) for t in range(width)],
            beyond=[sum(s.beyond[t] for s in per) for t in range(width)],
            failed=[i for i, s in zip(ids, per, strict=True) if s.failed],
            **kw,
        )


class Certificate(BaseModel):
    """``OUT/certificate.json`` (module docstring), one of the run's self-verifying records
    (``store.records``): stamped with the run's identity and a digest of its content, so an edited
    certificate, or one copied beside another run, is refused (``RecordDamaged``)."""

    format: str = CERTIFICATE_FORMAT
    hsx_version: str
    written: str
    by: str
    model: dict  # the spec's model identity (path, config hash, weight files' fingerprint)
    plan: str  # the plan's fingerprint: xxh3 over every sample's id, input_ids and loss_mask
    tokens: int
    samples: int
    layer_convention: str
    final_state: str  # the final state's label: after the final norm, or before it
    final_norm: str
    dtype: str
    taps: list[TapInfo]
    bands: Bands | None = None
    shadow: Recomputed | None = None
    reference: Recomputed | None = None
    fidelity: dict = {}  # the run's check, its baseline and the figure its sealed files carry
    # passed (every check so far), failed (``stopped`` or ``failures``), unchecked (no sample recomputed yet)
    verdict: str
    stopped: str | None = None  # why the last session stopped: a check failed (nothing of that batch was written)
    failures: list[str] = []  # states on disk that failed a check (the shadow's files, verify --reference)


def tap_info(spec) -> list[TapInfo]:
    """What each checked state of a run (``spec``: its ``RunSpec``) is, in words."""
    last = spec.model.num_layers - 1
    out = []
    for k in spec.layers:
        where = "its raw output, before the final norm" if k == last else f"transformers' hidden_states[{k + 1}]"
        out.append(
            TapInfo(name=f"layer {k}", layer=k, what=f"output of decoder layer {k} (model.layers[{k}]; {where})")
        )
    side = "output (last_hidden_state)" if spec.final_norm == "post" else f"input (decoder layer {last}'s raw output)"
    out.append(TapInfo(name="final", layer=None, what=f"the final norm's {side}"))
    return out


def read_certificate(run: Path) -> Certificate | None:
    """The run's certificate, None where there is none. Raises ``RecordDamaged`` for one that was
    edited, damaged or is another run's."""
    body = records.read_record(run, run / layout.CERTIFICATE, CERTIFICATE_FORMAT)
    return None if body is None else Certificate.model_validate(body)


def write_certificate(run: Path, spec, failure: str | None = None, reference: Recomputed | None = None) -> Certificate:
    """Write the run's certificate as the run stands: the taps, their bands, the shadow's samples on
    disk, the fidelity figures; ``failure``: why this session stopped (a check failed; the next
    session that ends well clears it); ``reference``: ``hsx verify --reference``'s recomputation
    (else the last one recorded is kept)."""
    from hsx.fidelity import read_baseline
    from hsx.store.format import NO_FIGURE, read_header
    from hsx.store.writer import read_seal

    try:
        before = read_certificate(run)
    except RecordDamaged:
        before = None  # rewritten whole from what the run holds (an earlier verify --reference's is lost)
    reference = reference or (before.reference if before else None)
    shadows: dict[int, Shadow] = {}
    total, shards = NO_FIGURE, -(-spec.plan.num_samples // spec.shard_size)
    for shard in range(shards):
        for r in (read_seal(run, shard) or {}).values():
            total = total + r.fidelity if r.fidelity is not None else total
    check = spec.certify
    if check is not None:
        for sid in range(spec.plan.num_samples):
            if shadowed(sid, check.every, check.first):
                path = layout.sample_path(run, sid, spec.shard_size)
                try:
                    taps = Taps.parse(read_header(path).metadata.get("taps"))
                except (OSError, ValueError):
                    continue  # not written yet (or damaged: the integrity line says so)
                if taps is not None and taps.shadow is not None:
                    shadows[sid] = taps.shadow
    failures = []
    if reference is not None and reference.failed:
        failures.append(f"hsx verify --reference: samples {reference.failed} differ from the plain path")
    shadow = Recomputed.of(shadows, every=check.every, first=check.first) if check is not None else None
    if shadow is not None and shadow.failed:
        failures.append(f"the shadow's samples {shadow.failed} differ from the plain path")
    base = read_baseline(run)
    checked = (shadow is not None and bool(shadow.samples)) or reference is not None
    verdict = "failed" if failures or failure else ("passed" if checked else "unchecked")
    cert = Certificate(
        hsx_version=__version__,
        written=now(),
        by=who(),
        model=spec.model.model_dump(mode="json"),
        plan=spec.plan.fingerprint,
        tokens=spec.plan.num_tokens,
        samples=spec.plan.num_samples,
        layer_convention=spec.layer_convention,
        final_state=spec.final_state,
        final_norm=spec.final_norm,
        dtype=spec.dtype,
        taps=tap_info(spec),
        bands=read_bands(run),
        shadow=shadow,
        reference=reference,
        fidelity={
            "check": None if spec.fidelity is None else spec.fidelity.model_dump(),
            "baseline": None if base is None else base.model_dump(),
            "figure": json.loads(total.text()),
        },
        verdict=verdict,
        stopped=failure,
        failures=failures,
    )
    records.write_record(run, run / layout.CERTIFICATE, cert.model_dump(mode="json"), indent=2)
    return cert


def line(cert: Certificate | None) -> str:
    """The certificate in one line, for ``hsx status``."""
    if cert is None:
        return "no certificate yet (written at the end of each session)"
    parts = [f"{cert.verdict}"]
    for name, r in (("shadow", cert.shadow), ("verify --reference", cert.reference)):
        if r is not None and r.samples:
            worst = max((d / b for d, b in zip(r.diff, r.bound, strict=True) if b), default=0.0)
            parts.append(f"{name}: {len(r.samples)} samples, worst tap at {worst:.2f} of its bound")
    stopped = [] if cert.stopped is None else [f"the last session stopped: {cert.stopped}"]
    return "; ".join(parts + cert.failures + stopped)
