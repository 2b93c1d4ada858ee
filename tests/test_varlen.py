"""The packed attention function with q/k head dim != v head dim (MLA), and the packing decision.

References are independent of hsx: a dense masked block-diagonal attention for the function itself,
and transformers' own ``output_hidden_states`` of one-sample forwards for a tiny DeepSeek-V3.
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from hsx.capture import varlen
from hsx.capture.transformers import TransformersBackend, varlen_blocker
from hsx.target import load_config

LENGTHS = [7, 1, 30, 12, 64]
MOE_SHARE = 0.01  # tokens a router near-tie may flip (they then differ O(1) from that layer on)


def reference_attention(q, k, v, lengths, scale):
    """[H, T, D] inputs; float64 softmax(q·kᵀ·scale) v with a block-diagonal causal mask."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(sample))
    allowed = (sample[:, None] == sample[None, :]) & (pos[:, None] >= pos[None, :])
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v  # [H, T, Dv]


def run_attention(q, k, v, lengths, scaling, **extra):
    """hsx_varlen on [H, T, D] inputs laid out as transformers passes them ([1, H, T, D])."""
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=q.device)
    out, _ = varlen.attention(
        None, q[None], k[None], v[None], None, scaling=scaling, cu_seq_lens_q=cu, max_length_q=max(lengths), **extra
    )
    return out[0].transpose(0, 1)  # [H, T, Dv]


DEVICES = [
    ("cpu", torch.float32, 1e-5),
    pytest.param(
        "cuda", torch.bfloat16, 4e-2, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


@pytest.mark.parametrize("device,dtype,tol", DEVICES, ids=["cpu-f32", "cuda-bf16"])
@pytest.mark.parametrize("dqk,dv", [(48, 32), (24, 40), (32, 32), (192, 128)])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("explicit_scale", [True, False], ids=["scale", "default-scale"])
def test_kernel_equals_block_diagonal_reference(device, dtype, tol, dqk, dv, kv_heads, explicit_scale):
    g = torch.Generator().manual_seed(dqk * 100 + dv + kv_heads)
    t = sum(LENGTHS)
    q = torch.randn(4, t, dqk, generator=g).to(device, dtype)
    k = torch.randn(kv_heads, t, dqk, generator=g).to(device, dtype)
    v = torch.randn(kv_heads, t, dv, generator=g).to(device, dtype)
    scaling = 0.3 if explicit_scale else None  # None: 1/sqrt of q's own head dim, not of a padded one
    before = dict(varlen.CALLS)
    out = run_attention(q, k, v, LENGTHS, scaling)
    assert varlen.CALLS["kernel"] == before["kernel"] + 1 and varlen.CALLS["per_sample"] == before["per_sample"]
    assert out.shape == (4, t, dv) and out.dtype == dtype
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), LENGTHS, scaling or dqk**-0.5)
    assert (out.cpu().double() - ref).abs().max().item() <= tol


def test_kernel_refuses_attention_it_does_not_implement():
    q = k = v = torch.randn(2, sum(LENGTHS), 16)
    with pytest.raises(NotImplementedError, match="sliding windows"):
        run_attention(q, k, v, LENGTHS, None, sliding_window=32)  # the 64-token sample exceeds it
    with pytest.raises(NotImplementedError, match="softcap"):
        run_attention(q, k, v, LENGTHS, None, softcap=30.0)
    wide = run_attention(q, k, v, LENGTHS, None, sliding_window=64)  # no sample exceeds it: no-op
    assert (wide.double() - reference_attention(q, k, v, LENGTHS, 16**-0.5)).abs().max().item() <= 1e-5


# ---------------------------------------------------------------- a tiny DeepSeek-V3 (MLA + MoE)


def tiny_mla_config(**overrides) -> DeepseekV3Config:
    """MLA with q/k head dim (nope + rope) != v head dim; layer 0 dense, the rest routed + shared experts."""
    fields = dict(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        max_position_embeddings=4096,
        initializer_range=0.1,
    )
    return DeepseekV3Config(**(fields | overrides))


def off_tokens(captured, reference, tol, relative=False) -> int:
    """Tokens of one sample whose state differs from the reference by more than ``tol`` (max abs,
    or the norm of the difference over the reference's norm)."""
    diff = captured.float() - reference.float()
    if relative:
        return int((diff.norm(dim=-1) / reference.float().norm(dim=-1) > tol).sum())
    return int((diff.abs().amax(dim=-1) > tol).sum())


def check_packed_against_singles(packed, singles, layers, hidden, tol, share, relative=False):
    """Per captured layer: layer 0 is dense (no router), so every token matches there; from the
    first MoE layer on, a small share of tokens may be off, all others within ``tol``."""
    total = sum(r[0].shape[0] for r in singles)
    for j, k in enumerate([*layers, "final"]):
        off = 0
        for i, (aux_ref, final_ref) in enumerate(singles):
            aux, final = packed.sample(i)
            got = final if k == "final" else aux[:, j * hidden : (j + 1) * hidden]
            want = final_ref if k == "final" else aux_ref[:, j * hidden : (j + 1) * hidden]
            off += off_tokens(got, want, tol, relative)
        limit = 0 if k == 0 else share * total
        assert off <= limit, f"layer {k}: {off} of {total} tokens beyond {tol}"


def random_samples(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).numpy() for n in lengths]


def test_mla_packed_capture_equals_one_sample_forwards():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_mla_config(), dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"  # the reference: transformers' own attention
    seqs = random_samples([150, 3, 77, 200, 41, 1, 120, 64, 300, 250, 90, 180, 33, 400], 512)
    layers = [0, 1, 2]  # hsx ids; the last layer is the final state, HF stores it normed
    singles = []
    with torch.no_grad():
        for s in seqs:
            states = model(torch.from_numpy(s)[None], output_hidden_states=True).hidden_states
            singles.append((torch.cat([states[k + 1][0] for k in layers], dim=-1), states[-1][0]))
    backend = TransformersBackend(model, layers)
    backend.set_packed(True)
    before = dict(varlen.CALLS)
    packed = backend.capture(list(range(len(seqs))), seqs)
    assert varlen.CALLS["kernel"] - before["kernel"] == model.config.num_hidden_layers
    assert varlen.CALLS["per_sample"] == before["per_sample"], "fell back to per-sample attention"
    assert packed.aux.shape == (1, sum(map(len, seqs)), len(layers) * 64)
    check_packed_against_singles(packed, singles, layers, 64, 1e-5, MOE_SHARE)


def test_a_packed_forward_never_makes_transformers_inspect_the_positions(monkeypatch):
    """transformers' packed-sequence detection reads ``position_ids`` back to the host (``.all()``),
    a device-to-host sync in every forward that let the GPU run dry between batches; the packed
    path needs no mask, so it must never get that far. Checked through the detection itself."""
    import transformers.masking_utils as masking

    calls = []
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: calls.append(1))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_mla_config(), dtype=torch.float32).eval()
    backend = TransformersBackend(model, [0, 2])
    seqs = random_samples([30, 7, 12], 512)
    ids = torch.from_numpy(np.concatenate(seqs))[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():  # the probe is live: sdpa with positions and no mask runs the detection
        backend.parts.body(input_ids=ids, position_ids=positions, use_cache=False)
    assert calls, "the probe saw no detection under sdpa"
    calls.clear()
    backend.set_packed(True)
    before = varlen.CALLS["kernel"]
    backend.capture([0, 1, 2], seqs)
    assert varlen.CALLS["kernel"] - before == model.config.num_hidden_layers
    assert not calls, "a packed forward ran transformers' packed-sequence detection"


# ---------------------------------------------------------------- the packing decision


@pytest.fixture
def fake_gpu(monkeypatch):
    """Let the CUDA branch of the decision run on any machine: a GPU of the given compute capability, or none."""

    def install(capability=(9, 0), available=True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(varlen, "_capability", lambda index: capability)

    return install


def config_dict(tmp_path, config) -> dict:
    config.save_pretrained(tmp_path)
    return load_config(tmp_path)


def test_blocker_none_for_mla_on_cpu_and_cuda(tmp_path, fake_gpu):
    mla = config_dict(tmp_path, tiny_mla_config(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
    assert varlen_blocker(mla, "cpu") is None
    assert varlen_blocker(mla, "cpu", "bfloat16") is None
    fake_gpu()
    assert varlen_blocker(mla, "cuda") is None  # auto dtype on CUDA: bfloat16
    assert varlen_blocker(mla, "cuda:1", "float16") is None


def test_blocker_names_what_keeps_the_kernel_from_running(tmp_path, fake_gpu):
    mla = config_dict(tmp_path / "mla", tiny_mla_config(qk_nope_head_dim=128, qk_rope_head_dim=64))
    wide = config_dict(tmp_path / "wide", tiny_mla_config(qk_nope_head_dim=256, qk_rope_head_dim=64))
    fake_gpu(available=False)
    assert "no CUDA device" in varlen_blocker(mla, "cuda")
    fake_gpu()
    assert "float32" in varlen_blocker(mla, "cuda", "float32")
    reason = varlen_blocker(wide, "cuda")
    assert "head dim 320 exceeds" in reason and "v head dim 32" in reason
    assert varlen_blocker(wide, "cpu") is None  # the CPU route takes any head dim
    fake_gpu((7, 5))
    assert "compute capability" in varlen_blocker(mla, "cuda")


@pytest.mark.parametrize(
    "config,reason",
    [
        ({"architectures": ["BloomForCausalLM"], "hidden_size": 64, "n_head": 4}, "pluggable"),
        ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0}, "softcapping"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding-window"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512, "layer_types": ["sliding_attention"]},
            "sliding-window",
        ),
        ({"architectures": ["Llama4ForCausalLM"], "attention_chunk_size": 8192}, "chunked"),
    ],
    ids=["not-pluggable", "softcap", "sliding", "sliding-layers", "chunked"],
)
def test_blocker_refuses_attention_the_packed_path_does_not_compute(config, reason):
    dims = {"hidden_size": 64, "num_attention_heads": 4}
    assert reason in varlen_blocker(dims | config, "cpu")


def test_blocker_ignores_a_sliding_window_that_is_switched_off():
    qwen = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4}
    assert varlen_blocker(qwen | {"sliding_window": 32768, "use_sliding_window": False}, "cpu") is None
    full = {"sliding_window": 4096, "layer_types": ["full_attention"] * 4}
    assert varlen_blocker(qwen | full, "cpu") is None
