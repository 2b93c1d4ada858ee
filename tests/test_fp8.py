"""FP8 checkpoints on torch's own kernels (hsx.capture.quantized.fp8), what runs on CPU: the
activation quantization, the operand layouts the block-scaled GEMM reads (partial blocks
included), the layer's arithmetic against a float64 reference of the same quantized operands, the
FP8 modules of a loaded checkpoint put on it (weights kept FP8), and the run option
``--quantized-compute``: its default, its refusals, the spec and the drift check.

torch has the block-scaled GEMM on CUDA only. Here the GEMM op gets a CPU kernel for the tests
alone: ``emulated_gemm``, which reads the operands exactly as cuBLAS documents them (A scaled per
row and 128 columns, B per 128x128 block) and computes in float64, so what is tested is everything
hsx does around the GEMM; test_cuda compares the real GEMM with the same reference.
"""

from __future__ import annotations

import json
import math
import shutil
from unittest import mock

import pytest
import torch

from conftest import TINY, conversations, hsx, load_states, write_jsonl
from hsx.capture.quantized import fp8
from hsx.errors import OptionError, Refused
from hsx.extract import ExtractOptions, extract
from hsx.store import layout
from test_checkpoint import LAYERS, SEQS, fp8_checkpoint, quantize_blocks, tiny_deepseek

FP8 = torch.float8_e4m3fn


def emulated_gemm(a, b, scale_a, scale_b) -> torch.Tensor:
    """What the block-scaled GEMM computes from its operands, in float64: a [M, K] scaled by
    ``scale_a`` [M, ceil(K/128)] per row and 128-column group, b [K, N] by ``scale_b`` [>= ceil(K/128),
    ceil(N/128)] per 128x128 block. Checks the layouts cuBLAS insists on."""
    m, k = a.shape
    n = b.shape[1]
    kb = math.ceil(k / 128)
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    assert scale_b.shape[0] % 4 == 0 and scale_b.shape[0] >= kb and scale_b.shape[1] == math.ceil(n / 128)
    assert scale_b.stride() == (1, scale_b.shape[0]) and b.stride() == (1, k)  # column-major
    assert m % 4 == 0, "cuBLAS refuses a token count that is not a multiple of 4"
    sa = scale_a.double().repeat_interleave(128, 1)[:, :k]
    sb = scale_b.double()[:kb].repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
    return (a.double() * sa) @ (b.double() * sb)


def gemm_operands(values, scales, weight, weight_scale):
    """The GEMM's four operands (a, b, scale_a, scale_b) as hsx lays them out."""
    a, scale_a = fp8.activation_operands(values, scales)
    b, scale_b = fp8.weight_operands(weight, weight_scale)
    return a, b, scale_a, scale_b


def _cpu_kernel(x, weight, weight_scale):
    a, b, scale_a, scale_b = gemm_operands(*fp8.quantize_activations(x), weight, weight_scale)
    return emulated_gemm(a, b, scale_a, scale_b)[: x.shape[0]].to(torch.bfloat16)


fp8.block_mm.register_kernel("cpu")(_cpu_kernel)  # the test process's stand-in for cuBLAS


def blocks64(weight, weight_scale) -> torch.Tensor:
    """A block-FP8 weight as it stands for, in float64 (no float32 product on the way)."""
    n, k = weight.shape
    scale = weight_scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return weight.double() * scale


def reference(values, scales, weight, weight_scale) -> torch.Tensor:
    """The product of the quantized operands as they stand for, in float64, block by block."""
    x = values.double() * scales.double().repeat_interleave(128, 1)[:, : values.shape[1]]
    return x @ blocks64(weight, weight_scale).t()


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------- the arithmetic


def test_activations_are_quantized_per_token_and_128_column_group():
    torch.manual_seed(0)
    x = torch.randn(5, 384, dtype=torch.bfloat16) * torch.tensor([1.0, 1e-3, 50.0]).repeat_interleave(128)
    x[2, 128:256] = 0  # a group of zeros
    values, scales = fp8.quantize_activations(x)
    assert values.dtype == FP8 and values.shape == (5, 384) and scales.dtype == torch.float32 and scales.shape == (5, 3)
    groups = x.float().unflatten(-1, (3, 128))
    assert torch.equal(scales, groups.abs().amax(-1).clamp(min=1e-12) * torch.tensor(1 / 448))
    v = values.float().unflatten(-1, (3, 128))
    nonzero = groups.abs().amax(-1) > 0
    assert torch.equal(v.abs().amax(-1)[nonzero], torch.full((int(nonzero.sum()),), 448.0))  # each group's amax -> 448
    assert torch.equal(v[2, 1], torch.zeros(128))
    # each value is its input over the group's scale, rounded to e4m3: 3 mantissa bits, half an ulp
    exact = groups / scales.unsqueeze(-1)
    big = exact.abs() >= 2**-6  # e4m3's normal range: relative rounding there
    assert ((v - exact).abs()[big] <= exact.abs()[big] * 2**-4).all()
    assert ((v - exact).abs()[~big] <= 2**-10).all()  # subnormals: absolute, half of 2**-9
    assert torch.equal(v, exact.to(FP8).float())


@pytest.mark.parametrize(
    "m,n,k",
    [
        (16, 256, 512),  # whole blocks everywhere
        (37, 576, 512),  # tokens not a multiple of 4; DeepSeek-V3's kv_a_proj_with_mqa: 4.5 row blocks
        (5, 192, 384),  # 3 column blocks: scales padded to 4 rows
        (3, 512, 128),  # 1 column block
    ],
)
def test_gemm_operands_are_laid_out_as_cublas_reads_them_and_change_no_product(m, n, k):
    torch.manual_seed(m)
    values, scales = fp8.quantize_activations(torch.randn(m, k))
    weight, weight_scale = quantize_blocks(torch.randn(n, k) * 0.05)
    a, b, scale_a, scale_b = gemm_operands(values, scales, weight, weight_scale)
    assert a.shape == (m + -m % 16, k) and b.shape == (k, n)
    assert scale_b.shape == (math.ceil(k / 128) + -math.ceil(k / 128) % 4, math.ceil(n / 128))
    got = emulated_gemm(a, b, scale_a, scale_b)  # asserts the layouts
    want = reference(values, scales, weight, weight_scale)
    assert torch.allclose(got[:m], want, rtol=1e-12, atol=1e-12)
    assert not got[m:].any()  # the padded rows are zeros, cut off


def test_fp8_linear_is_the_product_of_its_quantized_operands():
    """The layer: x [2, 7, K] with K = 192 (1.5 column blocks: the weight padded with zero columns
    as ``install`` pads it), a bias, bfloat16 out. Against the float64 product of the same
    quantized operands the only error is the output's rounding to bfloat16 (2**-9 relative);
    against the unquantized input (the ``dequantized`` route's product) it is e4m3's, ~2-3%."""
    torch.manual_seed(1)
    x = torch.randn(2, 7, 192, dtype=torch.bfloat16)
    weight, weight_scale = quantize_blocks(torch.randn(320, 192) * 0.05)
    padded = torch.nn.functional.pad(weight.view(torch.uint8), (0, 64)).view(FP8)
    bias = torch.randn(320, dtype=torch.bfloat16)
    out = fp8.fp8_linear(x, padded, weight_scale, bias)
    assert out.shape == (2, 7, 320) and out.dtype == torch.bfloat16
    values, scales = fp8.quantize_activations(torch.nn.functional.pad(x.reshape(14, 192), (0, 64)))
    exact = reference(values, scales, padded, weight_scale) + bias.double()
    assert (out.reshape(14, 320).double() - exact).abs().max() <= exact.abs().max() * 2**-8
    dequantized = x.reshape(14, 192).double() @ blocks64(weight, weight_scale).t()
    assert 5e-3 < _rel(out.reshape(14, 320) - bias, dequantized) < 5e-2


def test_experts_expand_to_their_dequantized_values_a_few_at_a_time(monkeypatch):
    torch.manual_seed(2)
    stored = [quantize_blocks(torch.randn(200, 300)) for _ in range(5)]  # partial blocks both ways
    weight, scale = torch.stack([q for q, _ in stored]), torch.stack([s for _, s in stored])
    monkeypatch.setattr(fp8, "_EXPAND_CHUNK", 2 * 200 * 300)  # two experts at a time: 3 chunks
    got = fp8.expand_experts(weight, scale, (128, 128), torch.bfloat16)
    assert got.dtype == torch.bfloat16
    for e in range(5):
        assert torch.equal(got[e], fp8.dequantize_blocks(weight[e], scale[e], (128, 128), torch.bfloat16))


def test_where_the_fp8_route_runs_and_which_layouts_it_takes():
    assert fp8.gemm_blocker("cpu", "bfloat16", [128, 128]) == "torch has no block-scaled FP8 GEMM on cpu"
    assert "128x128 weight blocks" in fp8.gemm_blocker("cuda", "bfloat16", [64, 64])
    assert "128x128 weight blocks" in fp8.gemm_blocker("cuda", "bfloat16", None)  # per-tensor scales
    assert "activation_scheme 'static'" in fp8.gemm_blocker("cuda", "bfloat16", [128, 128], "static")
    assert "writes bfloat16" in fp8.gemm_blocker("cuda", "float32", [128, 128])
    config = {"intermediate_size": 18432, "moe_intermediate_size": 2048}  # DeepSeek-V3, Kimi-K2
    assert fp8.parallel_refusal(config, 8) is None and fp8.parallel_refusal(config, 16) is None
    assert fp8.parallel_refusal({"intermediate_size": 384}, 1) is None
    assert "intermediate_size 384 over 2 ranks" in fp8.parallel_refusal({"intermediate_size": 384}, 2)


# ---------------------------------------------------------------- a checkpoint's FP8 modules


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    plain = tiny_deepseek(root / "plain")
    fp8_checkpoint(plain, root / "fp8", root / "reference")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # for hsx extract
        shutil.copy(TINY / name, root / "fp8" / name)
    return {p.name: p for p in root.iterdir()}


def load_fp8(path):
    """The checkpoint as transformers loads it with dequantize off, FP8 modules and FP8 weights,
    which it does only where it sees a GPU of compute capability 8.9 or more: it is shown one."""
    from transformers import AutoModelForCausalLM

    from hsx.capture import checkpoint

    config = checkpoint.plan(path, "cpu", "bfloat16").quantization_config
    config.dequantize = False
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
    ):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config).eval()


def test_installed_checkpoint_keeps_fp8_weights_and_computes_near_the_dequantized_model(models):
    """Every FP8 linear layer and MoE layer of the tiny DeepSeek-V3 on hsx's forwards, the weights
    still 1 byte each; its states near the same model dequantized and run in bfloat16. The FP8
    activations cost e4m3's rounding, 3 mantissa bits: ~2.7% relative per GEMM (rms of a uniform
    error of half a step, 2**-4 at most), ~4-5% per token after the chained GEMMs of 1-3 layers
    here (measured 3.8-5.0% medians), hence 7%, and more than 1% (FP8 really ran); router
    near-ties may flip a token's experts: counted, at most 10% of the tokens beyond 12%."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    model = load_fp8(models["fp8"])
    fp8_bytes_before = fp8.weight_bytes(model)
    assert not fp8.installed(model)
    installed = fp8.install(model)
    assert fp8.installed(model)  # the shadow's bound widens for e4m3 inputs (certify.bound)
    linears = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert installed.linear == len(linears) == 3 * 5 + 3 + 2 * 3  # attention, dense MLP, shared experts
    assert installed.experts == sum(isinstance(m, FP8Experts) for m in model.modules()) == 2
    assert set(installed.padded) == {f"model.layers.{i}.self_attn.q_b_proj" for i in range(3)}  # 192 columns
    assert "24 FP8 linear layers on torch's block-scaled FP8 GEMM, 2 MoE layers" in str(installed)
    for name in linears:
        assert model.get_submodule(name).weight.dtype == FP8
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == FP8
    # the padded columns (3 layers x 512 rows x 64) are all the memory added
    assert fp8.weight_bytes(model) == fp8_bytes_before + 3 * 512 * 64
    reference = AutoModelForCausalLM.from_pretrained(models["reference"], dtype=torch.bfloat16).eval()
    assert fp8.weight_bytes(model) < 0.75 * fp8.weight_bytes(reference)  # embeddings + head stay bf16 here
    calls = []
    original = fp8.expand_experts
    with torch.no_grad(), mock.patch.object(fp8, "expand_experts", lambda *a: calls.append(a) or original(*a)):
        for ids in SEQS:
            ids = torch.as_tensor(ids)[None].long()
            got = model(ids, output_hidden_states=True).hidden_states
            want = reference(ids, output_hidden_states=True).hidden_states
            for k in [*(i + 1 for i in LAYERS), -1]:
                errors = (got[k][0].float() - want[k][0].float()).norm(dim=-1) / want[k][0].float().norm(dim=-1)
                assert (errors > 0.12).float().mean() <= 0.1, (k, errors)  # near-ties flip a few tokens' experts
                assert 0.01 < errors.median() < 0.07, (k, errors.median())
    assert len(calls) == 2 * 2 * len(SEQS)  # gate_up and down of each MoE layer, per forward


def test_fp8_experts_expanded_a_slice_at_a_time_give_the_whole_layers_bits(models):
    """The installed FP8 experts of a MoE layer under a budget of two experts: expanded two at a
    time (never the layer at once), the layer's output equal to the whole layer's bit for bit."""
    from hsx.capture.quantized import experts as jit

    model = load_fp8(models["fp8"])
    fp8.install(model)
    experts = model.model.layers[1].mlp.experts
    count, top_k = experts.num_experts, model.config.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(101, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    routed = torch.stack([torch.randperm(count, generator=gen)[:top_k] for _ in range(101)])
    weights = torch.rand(101, top_k, generator=gen)
    calls = []
    original = fp8.expand_experts
    with torch.no_grad(), mock.patch.object(fp8, "expand_experts", lambda *a: calls.append(a) or original(*a)):
        whole = experts(hidden, routed, weights)
        assert {c[0].shape[0] for c in calls} == {count}
        calls.clear()
        experts.slice_bytes = 2 * jit.expert_bytes(experts, torch.bfloat16)
        got = experts(hidden, routed, weights)
    assert {c[0].shape[0] for c in calls} == {2} and len(calls) == 2 * count // 2
    assert torch.equal(got, whole)


def test_experts_whose_scales_are_not_their_blocks_are_refused(models):
    from hsx.errors import UnsupportedModel

    model = load_fp8(models["fp8"])
    experts = model.model.layers[1].mlp.experts
    experts.gate_up_proj_scale_inv = torch.nn.Parameter(experts.gate_up_proj_scale_inv[:, :1], requires_grad=False)
    with pytest.raises(UnsupportedModel, match=r"gate_up_proj.*use --quantized-compute dequantized"):
        fp8.install(model)


# ---------------------------------------------------------------- the run option


def test_quantized_compute_is_recorded_defaulted_refused_and_part_of_the_drift_check(models, tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(3))
    out = tmp_path / "run"
    common = dict(model=str(models["fp8"]), data=[data], device="cpu", layers=LAYERS, shard_size=3, writers=1)
    said = []
    with pytest.raises(OptionError, match="--quantized-compute fp8 cannot run here: torch has no block-scaled"):
        extract(ExtractOptions(out=out, quantized_compute="fp8", **common), log=said.append)
    with pytest.raises(OptionError, match="takes fp8, int4 or dequantized, not 'int8'"):
        extract(ExtractOptions(out=out, quantized_compute="int8", **common), log=said.append)
    assert not (out / layout.SPEC).exists()
    assert extract(ExtractOptions(out=out, **common), log=said.append).complete  # the CPU default
    assert "quantized compute: dequantized, since torch has no block-scaled FP8 GEMM on cpu" in said
    spec = json.loads((out / layout.SPEC).read_text())
    assert spec["quantized_compute"] == "dequantized"
    before = {p: p.read_bytes() for p in (out / "shards").rglob("*.safetensors")}
    with pytest.raises(Refused, match="quantized compute: run has dequantized, asked for fp8"):
        extract(ExtractOptions(out=out, quantized_compute="fp8", **common), log=said.append)
    assert extract(ExtractOptions(out=out, quantized_compute="dequantized", **common), log=said.append).complete
    assert {p: p.read_bytes() for p in (out / "shards").rglob("*.safetensors")} == before
    first = load_states(layout.sample_path(out, 0, 3))
    assert first["hidden_states"].dtype == torch.float32  # CPU's dtype: dequantized weights in float32
    # an unquantized model has no such choice
    with pytest.raises(OptionError, match="applies to FP8 and INT4 checkpoints"):
        extract(ExtractOptions(out=tmp_path / "plain", quantized_compute="fp8", **{**common, "model": str(TINY)}))
    with pytest.raises(OptionError, match=r"int4 applies to INT4-packed routed experts; .* has none"):
        extract(ExtractOptions(out=tmp_path / "fp8-int4", quantized_compute="int4", **common))
    plain = tmp_path / "tiny"
    assert extract(ExtractOptions(out=plain, **{**common, "model": str(TINY), "layers": None}), log=said.append)
    assert json.loads((plain / layout.SPEC).read_text())["quantized_compute"] is None


def test_cli_takes_quantized_compute_and_refuses_a_bad_value(tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    args = ("--model", TINY, "--data", data, "--out", tmp_path / "r", "--quantized-compute", "fp8")
    proc = hsx("extract", *args, check=False)
    assert proc.returncode != 0 and "applies to FP8 and INT4 checkpoints; " in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_weights_quantize_as_checkpoints_store_them():
    torch.manual_seed(3)
    w = torch.randn(3, 200, 300)  # leading expert dim, partial blocks both ways
    values, scales = fp8.quantize_weight(w)
    assert values.dtype == FP8 and values.shape == w.shape and scales.shape == (3, 2, 3)
    for e in range(3):
        q, s = quantize_blocks(w[e])
        assert torch.equal(values[e].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales[e], s)


def test_bench_builds_a_model_as_its_block_fp8_checkpoint_would_load():
    """hsx bench's block-FP8 variant (run on CUDA): a bf16 model's linear layers and experts become
    transformers' FP8 modules holding the quantized weights, on hsx's kernels; here checked with the
    emulated GEMM against the same bf16 model (e4m3 activations and weights: a few % per token)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from hsx.bench.extract import to_block_fp8

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, n_group=1, topk_group=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    dense.load_state_dict(model.state_dict())
    experts = model.model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    before, after = to_block_fp8(model)
    assert after < 0.51 * before
    stored = model.model.layers[1].mlp.experts
    values, scales = fp8.quantize_weight(experts)
    assert torch.equal(stored.gate_up_proj.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(stored.gate_up_proj_scale_inv, scales)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.model.layers[0].mlp.down_proj.weight.dtype == FP8
    ids = torch.randint(0, 512, (1, 40))
    with torch.no_grad():
        got, want = model(ids).logits[0].float(), dense(ids).logits[0].float()
    errors = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert 0.01 < errors.median() < 0.1 and (errors > 0.2).float().mean() <= 0.1, errors


def test_bench_refuses_the_fp8_model_where_the_gemm_cannot_run(tmp_path):
    from hsx.bench.extract import run_bench

    with pytest.raises(OptionError, match="the block-FP8 model cannot run here: torch has no block-scaled"):
        run_bench(None, "cpu", 4, 32, 8, 64, 256, 0, 1, tmp_path, fp8=True)
    assert not any(tmp_path.iterdir())  # refused before anything was built or written
