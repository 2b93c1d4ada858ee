"""Padding-free forward: samples packed into one row, attention block-diagonal by cu_seqlens.

Packing with reset ``position_ids`` alone is WRONG under transformers' sdpa and flex paths (samples
attend to each other). So hsx registers its own attention function, ``hsx_varlen``, that reads
``cu_seq_lens_q`` / ``max_length_q`` from the forward's kwargs (transformers passes them down to
every attention call) and attends within each sample only, in one attention call for the row:
- on CUDA, ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention inside PyTorch);
- elsewhere, one causal SDPA over the samples laid out as right-padded rows of a batch (exact:
  under the causal mask a real query never reaches the padding after its sample);
- where FlashAttention cannot run (see ``blocker``), causal SDPA per sample: exact, slower.
FlashAttention and SDPA's CPU kernel want one head dim for q, k and v; MLA (DeepSeek-V3: q/k 192,
v 128) gets it by zero-padding the narrower side and slicing the output, which is exact: zero
columns add nothing to q·k and give zero output columns.
No mask function is registered with it: transformers then builds no mask at all (no [T, T] mask)
and skips its packed-sequence detection on ``position_ids``, whose ``.all()`` was a device-to-host
sync in every forward, which let the GPU run dry between batches. Rotary positions come from the
per-sample ``position_ids``. The reference tests compare this path with one-sample forwards.
When the layers are compiled, this function stays outside the graph: it is one kernel already,
and tracing it would turn its call counter into a guard that forces a recompile on every call.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
import torch.nn.functional as F

NAME = "hsx_varlen"
CALLS = {"kernel": 0, "per_sample": 0}  # which path ran (kernel: one call for the whole row); bench reports it
FLASH_MAX_HEAD_DIM = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _kernel():
    """torch's varlen_attn and its parameters' names ((None, {}) on an older torch), imported on
    first use: the module imports torch's compiler (about a second), which CPU runs never need."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    return varlen_attn, inspect.signature(varlen_attn).parameters


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def blocker(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why attention of this head dim (the larger of q/k and v) would run per sample here, or None
    when the whole packed row goes through one kernel call. One predicate for the attention itself
    and for choosing a layout, so the two never disagree."""
    device = torch.device(device)
    if device.type != "cuda":
        return None  # one batched SDPA takes any head dim and dtype
    if not torch.cuda.is_available():
        return "no CUDA device"
    kernel, params = _kernel()
    if kernel is None or not ({"window_size", "is_causal"} & params.keys()):
        return f"torch {torch.__version__} has no causal torch.nn.attention.varlen.varlen_attn"
    if dtype not in FLASH_DTYPES:
        return f"FlashAttention takes float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if head_dim > FLASH_MAX_HEAD_DIM:
        return f"head dim {head_dim} exceeds FlashAttention's {FLASH_MAX_HEAD_DIM}"
    major, minor = _capability(device.index)
    if (major, minor) < (8, 0):
        return f"FlashAttention needs compute capability 8.0 or newer, this GPU has {major}.{minor}"
    return None


def _same_head_dim(q, k, v):
    """Zero-pad q and k, or v, to the larger head dim (exact; the caller slices the output)."""
    d = max(q.shape[-1], v.shape[-1])
    if q.shape[-1] < d:
        q, k = F.pad(q, (0, d - q.shape[-1])), F.pad(k, (0, d - k.shape[-1]))
    if v.shape[-1] < d:
        v = F.pad(v, (0, d - v.shape[-1]))
    return q, k, v


def _flash(q, k, v, cu, max_len, scale):
    """[T, H, D] -> [T, H, D] through FlashAttention's varlen kernel (q, k, v of one head dim)."""
    kernel, params = _kernel()
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return kernel(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _batched(q, k, v, cu, max_len, scale):
    """[T, H, D] -> [T, H, D]: the samples as right-padded rows of [N, H, max_len, D], one causal
    SDPA. A padding slot only holds a query whose output is dropped and keys behind every real
    query of its row, so which token fills it does not matter (the index is clamped in range)."""
    pos = torch.arange(max_len, device=q.device)
    index = cu[:-1, None].long() + pos  # [N, max_len] into the packed axis
    real = pos < cu.diff()[:, None]
    index = index.clamp(max=q.shape[0] - 1)
    rows = [x[index].transpose(1, 2) for x in (q, k, v)]  # [N, H, max_len, D]
    out = F.scaled_dot_product_attention(*rows, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)[real]


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


def _refuse_unimplemented(kwargs: dict, max_len: int) -> None:
    """Attention features this function does not compute: fail rather than give other numbers."""
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"hsx_varlen does not implement attention {name}: use padded rows")
    window = kwargs.get("sliding_window")
    if window is not None and max_len > window:
        raise NotImplementedError(f"hsx_varlen does not implement sliding windows ({window} tokens): use padded rows")


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-function signature; query/key/value are [1, H, T, D]; value's head
    dim may differ from query's (MLA)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise RuntimeError("hsx_varlen attention needs one packed row and cu_seq_lens_q")
    max_len = int(kwargs["max_length_q"])
    _refuse_unimplemented(kwargs, max_len)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5  # of the unpadded head dim
    dv = v.shape[-1]
    if blocker(max(q.shape[-1], dv), q.dtype, q.device) is None:
        route = _flash if q.is_cuda else _batched
        out = route(*_same_head_dim(q, k, v), cu, max_len, scale)[..., :dv]
        CALLS["kernel"] += 1
    else:
        out = _per_sample(q, k, v, cu, scale)
        CALLS["per_sample"] += 1
    return out[None], None


@functools.cache
def _outside_graphs():
    """``attention`` kept out of compiled graphs (see above); made on first use, since wrapping it
    imports torch's compiler, which runs that never compile do not need (about a second)."""
    return torch.compiler.disable(attention)


def register(compiled: bool) -> str:
    """Make ``NAME`` this attention (transformers looks it up by name at each call); ``compiled``:
    the decoder layers are (or are about to be) compiled."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _outside_graphs() if compiled else attention)
    return NAME


def supported(model) -> bool:
    """Models whose attention goes through transformers' pluggable attention functions."""
    return bool(getattr(model, "_supports_attention_backend", False))
