"""Pre-norm final states for exports: post-norm from pre-norm (exact), pre-norm from post-norm (up to eps).

The norm itself (which tensor, which family, how it is applied) is ``hsx.finalnorm``'s; ``w`` below
is its per-channel scale. hsx stores the final state AFTER the norm: ``post = w * x / sqrt(mean(x^2)
+ eps)``. Some trainers want the state BEFORE it and apply the norm themselves. ``x`` is lost, but
an RMSNorm is invariant to a per-token scale of its input, so ``y = post / w`` (= ``x /
sqrt(mean(x^2) + eps)``) gives ``norm(y) = post / sqrt(mean(y^2) + eps)`` with ``mean(y^2) = m /
(m + eps)``, m = mean(x^2): a per-token scale of the logits by 1 - O(eps), plus one rounding in
the storage dtype. Where the run holds the last decoder layer's raw output (hsx layer N-1) the
pre-norm state is exact instead. Every converted sample is checked: the norm of what is exported
must give back the stored state.

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


def prenorm_from_post(norm: FinalNorm, post: torch.Tensor) -> torch.Tensor:
    """A valid input to ``norm`` that gives back ``post`` (to 1 - O(eps)), in post's dtype."""
    return (post.float() / norm.scale).to(post.dtype)


def norm_error(norm: FinalNorm, pre: torch.Tensor, post: torch.Tensor) -> float:
    """Largest per-token relative L2 error of norm(pre), in float32, against ``post``."""
    ref = post.float()
    diff = (norm.apply(pre.float()) - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    return float(diff.max()) if diff.numel() else 0.0


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
