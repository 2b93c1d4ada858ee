"""Padding-free forward: samples packed into one row, attention block-diagonal by cu_seqlens.

Packing with reset ``position_ids`` alone is WRONG under transformers' sdpa and flex paths (samples
attend to each other). So hsx registers its own attention function, ``hsx_varlen``, that reads
``cu_seq_lens_q`` / ``max_length_q`` from the forward's kwargs (transformers passes them down to
every attention call) and attends within each sample only:
- on CUDA, ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention inside PyTorch);
- elsewhere (and for shapes the kernel refuses), causal SDPA per sample: exact, slower.
Its mask function returns None: no [T, T] mask is ever built. Rotary positions come from the
per-sample ``position_ids``. The reference tests compare this path with one-sample forwards.
When the layers are compiled, this function stays outside the graph: it is one kernel already,
and tracing it would turn its call counter into a guard that forces a recompile on every call.
"""

from __future__ import annotations

import inspect
import itertools

import torch
import torch.nn.functional as F

NAME = "hsx_varlen"
CALLS = {"kernel": 0, "per_sample": 0}  # which path ran: the benchmark reports it

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _PARAMS = inspect.signature(_varlen_attn).parameters
except ImportError:  # older torch
    _varlen_attn, _PARAMS = None, {}


def _kernel(q, k, v, cu, max_len, scale):
    """[T, H, D] -> [T, H, D] through FlashAttention, or None when it cannot be used here."""
    if _varlen_attn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if q.shape[-1] != v.shape[-1]:
        return None
    kwargs = {"scale": scale}
    if "window_size" in _PARAMS:
        kwargs["window_size"] = (-1, 0)  # causal
    elif "is_causal" in _PARAMS:
        kwargs["is_causal"] = True
    else:
        return None
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _PARAMS:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return _varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _per_sample(q, k, v, cu, scale):
    """Exact fallback: causal SDPA on each sample's block. q/k/v are [T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    bounds = cu.tolist()
    for lo, hi in itertools.pairwise(bounds):
        qs, ks, vs = (x[lo:hi].transpose(0, 1) for x in (q, k, v))
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, dim=0), vs.repeat_interleave(rep, dim=0)
        out[lo:hi] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


@torch.compiler.disable
def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-function signature; query/key/value are [1, H, T, D]."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise RuntimeError("hsx_varlen attention needs one packed row and cu_seq_lens_q")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = _kernel(q, k, v, cu, int(kwargs["max_length_q"]), scaling)
    if out is None:
        out = _per_sample(q, k, v, cu, scaling)
        CALLS["per_sample"] += 1
    else:
        CALLS["kernel"] += 1
    return out[None], None


def no_mask(*args, **kwargs):
    return None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME


def supported(model) -> bool:
    """Models whose attention goes through transformers' pluggable attention functions."""
    return bool(getattr(model, "_supports_attention_backend", False))
