"""Pre-norm final states for exports: post-norm from pre-norm (exact), pre-norm from post-norm.

The norm itself (which tensor, which family, how it is applied) is ``hsx.finalnorm``'s; ``w`` below
is its per-channel scale. A run stores the final state after the norm (``post = w * x / sqrt(m +
eps)``, m = mean(x^2)) unless it was asked to keep it before (``--final-state pre``); some trainers
want the other one. From ``x`` the norm gives ``post`` exactly. The other way, ``y = post / w``
(= ``x / sqrt(m + eps)``) holds ``x``'s direction; in exact arithmetic its mean square would give
the length: ``mean(y^2) = m / (m + eps)``, so the deficit ``d = 1 - mean(y^2) = eps / (m + eps)`` and
``x = y * sqrt(eps / d)``. Where m is far above eps (most models) ``d`` is a few roundings and the
length so estimated is essentially arbitrary; exports say so (``trainer.DIRECTION_ONLY``).
Measured on the stored ``post``, ``d`` also carries its rounding, and then
``norm(y * sqrt(eps / d)) = post / sqrt(mean(y^2) + d)`` is the stored ``post`` exactly (to the
arithmetic's own rounding): what the trainer's norm must give back. Where ``d`` is below the
dtype's rounding (``finfo.eps``: m beyond about eps / finfo.eps, or no deficit at all), it tells
nothing: the state is ``y`` itself, whose norm errs by ``d / 2``, under half that rounding.
Dividing by ``w`` alone everywhere (what hsx did before) left ``norm(y)`` off by ``eps / (2m)``:
3.4e-3 on a small float32 model whose final states have a mean square of 1.5e-3, refused as a wrong
model. A lossy state (fp8) has no meaningful deficit: its pre-norm state is ``y``. Every converted
sample is checked: the norm of what is exported must give back the stored state, and ``diagnose``
says what was measured where it does not.

    python -m hsx.export.norm OUT [--model PATH] [--samples 16]

measures the error of the target distribution this conversion gives against transformers' own
forward pass on the run's samples.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hsx.data import HsxDataset
from hsx.errors import NormUnavailable
from hsx.finalnorm import FinalNorm, locate
from hsx.spec import load_spec
from hsx.store.codec import Codec, is_lossless
from hsx.target import model_dir_for

# Relative error allowed between norm(exported pre-norm) and the stored post-norm state, per token:
# a few roundings of the storage dtype (float32 also absorbs the O(eps) scale above).
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}
# A run stored as fp8 adds a per-token scale: an RMSNorm's output always has rms(out / w) = 1, and a
# quantized post-norm state does not (each value errs by at most 2^-4 of itself, e4m3's normal range),
# so norm(post / w) is post times 1 / rms(post / w), which is within 2^-4 / (1 - 2^-4) = 1/15 of 1.
FP8_SCALE = 1 / 15


def tolerance(dtype: str, codec: Codec) -> float:
    """What ``norm_error`` may reach for a run of this dtype and storage codec."""
    return TOLERANCE[dtype] + (0.0 if is_lossless(codec) else FP8_SCALE)


def load_final_norm(model_dir: Path, hidden_size: int) -> FinalNorm:
    """The checkpoint's final norm, refused unless it can be inverted (every scale finite, non-zero)."""
    norm = locate(model_dir, hidden_size)
    scale = norm.scale
    if not torch.isfinite(scale).all() or bool((scale == 0).any()):
        raise NormUnavailable(
            f"{norm.tensor} has zero or non-finite entries: the post-norm state loses those channels, "
            "so no pre-norm state can be recovered from it"
        )
    return norm


def prenorm_from_post(norm: FinalNorm, post: torch.Tensor, lossless: bool = True) -> torch.Tensor:
    """The pre-norm state ``post`` came from (its length from the mean-square deficit where the
    dtype's rounding leaves it measurable, see above), in post's dtype; ``lossless`` False (a
    quantized ``post``): its direction, ``post / w``."""
    y = post.double() / norm.scale.double()
    if lossless:
        deficit = 1.0 - y.pow(2).mean(-1, keepdim=True)
        measurable = deficit > torch.finfo(post.dtype).eps
        y = y * torch.where(measurable, torch.sqrt(norm.eps / deficit.clamp_min(1e-300)), 1.0)
    return y.to(post.dtype)


def norm_error(norm: FinalNorm, pre: torch.Tensor, post: torch.Tensor) -> float:
    """Largest per-token relative L2 error of norm(pre), in float32, against ``post``."""
    diff = _token_errors(norm, pre, post)
    return float(diff.max()) if diff.numel() else 0.0


def _token_errors(norm: FinalNorm, pre: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    ref = post.float()
    return (norm.apply(pre.float()) - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


def diagnose(norm: FinalNorm, pre: torch.Tensor, post: torch.Tensor, limit: float, model: str) -> str:
    """Why norm(pre) is not ``post``: what was measured at the worst token, then the likely causes,
    most likely first, as the measurement orders them. ``model`` is the folder the norm was read from."""
    errors = _token_errors(norm, pre, post).nan_to_num(float("inf"))
    t = int(errors.argmax())
    got, want = norm.apply(pre[t].float()), post[t].float()
    cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    ratio = float(got.norm() / want.norm().clamp_min(1e-30))
    bad = int((~torch.isfinite(post)).any(-1).sum())
    measured = (
        f"token {t} of {post.shape[0]} errs by {float(errors[t]):.2e} (limit {limit:.0e}): norm(exported) has "
        f"{ratio:.6f} times the stored state's length, cosine {cosine:.6f} to it; {bad} tokens hold NaN or inf"
    )
    where = f"the final norm read from {model} ({norm.tensor}, eps {norm.eps}{', scale 1 + w' if norm.offset else ''})"
    causes = []
    if bad:
        causes.append("the stored state overflowed (NaN or inf): the model does so in the run's dtype on this sample")
    if cosine < 1 - limit:  # another direction: another per-channel weight
        causes += [
            f"{where} is not the one the run was made with: its weights differ (a checkpoint changed in place can "
            "pass the fingerprint, which reads parts of each weight file)",
            f"{norm.tensor} is not the norm the model applies last (hsx located it by name; see hsx.finalnorm)",
        ]
    else:  # the direction holds: only the length differs, which eps and the family set
        causes += [
            f"the model's final norm computes otherwise than {where}: another eps, or not a plain RMSNorm",
            f"{where} is not the one the run was made with (a changed weight scale)",
        ]
    return f"measured: {measured}. Likely causes, most likely first: " + "; ".join(
        f"({i}) {c}" for i, c in enumerate(causes, 1)
    )


# ---------------------------------------------------------------- measuring against the reference


@torch.no_grad()
def measure(run: Path, model_dir: Path, samples: int = 16) -> dict:
    """Target-distribution error of post/weight as a pre-norm state, against transformers' forward.

    For each sample: x_ref = the input of the model's final norm (a forward hook), then compare
    softmax(lm_head(norm(x_ref))) with softmax(lm_head(norm(post / w))), where post is the file's
    state and norm is the model's own module (the one a trainer rebuilds from the checkpoint).
    """
    from transformers import AutoModelForCausalLM

    spec = load_spec(run)
    dtype = getattr(torch, spec.dtype)
    fn = load_final_norm(model_dir, spec.model.hidden_size)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    norm_module = model.get_submodule(fn.tensor.removesuffix(".weight"))
    head = model.get_output_embeddings()
    captured: list[torch.Tensor] = []
    hook = norm_module.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
    ds = HsxDataset(run, verify=True, sealed_only=False)
    stats = {"samples": 0, "tokens": 0, "max_abs_dprob": 0.0, "max_kl": 0.0, "top1_agree": 0, "max_state_err": 0.0}
    stats |= {"max_dlogit_rel": 0.0, "stored_max_abs_dprob": 0.0, "stored_max_kl": 0.0, "stored_top1_agree": 0}
    try:
        for i in range(min(samples, len(ds))):
            s = ds[i]
            captured.clear()
            model(input_ids=s["input_ids"][None])
            x_ref = captured[-1][0]
            post = s["hidden_states"]
            pre = prenorm_from_post(fn, post)
            ref_logits = head(norm_module(x_ref)).float()
            our_logits = head(norm_module(pre)).float()
            p, q = ref_logits.softmax(-1), our_logits.softmax(-1)
            kl = (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)
            scale = ref_logits.abs().amax(-1).clamp_min(1e-30)
            stats["max_abs_dprob"] = max(stats["max_abs_dprob"], float((p - q).abs().max()))
            stats["max_kl"] = max(stats["max_kl"], float(kl.max()))
            rel = ((our_logits - ref_logits).abs().amax(-1) / scale).max()
            stats["max_dlogit_rel"] = max(stats["max_dlogit_rel"], float(rel))
            stats["top1_agree"] += int((p.argmax(-1) == q.argmax(-1)).sum())
            # the same figures for the stored post-norm state as is: what the forward itself varies by
            r = head(post).float().softmax(-1)
            kl_r = (p * (p.clamp_min(1e-30).log() - r.clamp_min(1e-30).log())).sum(-1)
            stats["stored_max_abs_dprob"] = max(stats["stored_max_abs_dprob"], float((p - r).abs().max()))
            stats["stored_max_kl"] = max(stats["stored_max_kl"], float(kl_r.max()))
            stats["stored_top1_agree"] += int((p.argmax(-1) == r.argmax(-1)).sum())
            stats["max_state_err"] = max(stats["max_state_err"], norm_error(fn, pre, post))
            stats["tokens"] += int(post.shape[0])
            stats["samples"] += 1
    finally:
        hook.remove()
    for key in ("top1_agree", "stored_top1_agree"):
        stats[key] = stats[key] / max(stats["tokens"], 1)
    stats |= {"dtype": spec.dtype, "eps": fn.eps, "norm_key": fn.tensor}
    return stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hsx.export.norm", description=measure.__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--model", default=None, help="Model folder (default: the run spec's).")
    ap.add_argument("--samples", type=int, default=16)
    args = ap.parse_args(argv)
    model_dir = model_dir_for(args.run, load_spec(args.run), args.model)
    print(json.dumps(measure(args.run, model_dir, args.samples), indent=1))


if __name__ == "__main__":
    main()
