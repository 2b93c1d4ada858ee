"""GPU-only checks (skipped without CUDA): the varlen kernel and the pinned staging path.

The packed path's correctness on CPU is covered by test_capture and test_varlen; here the
FlashAttention kernel itself (eager and with compiled layers, and with MLA's unequal head dims) is
compared with eager one-sample forwards, in bf16, a real extraction through the pinned ring is
compared with float32 CPU states, and a compiled run's resume in a fresh process (compiling again,
no cache) is compared byte for byte.
"""

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY, convs, hsx, run_files  # noqa: F401  (fixture)
from hsx.capture import varlen
from hsx.capture.transformers import TransformersBackend, varlen_blocker
from hsx.extract import ExtractOptions, extract
from hsx.store import layout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("compiled", [False, True])
def test_varlen_kernel_packed_equals_one_sample_forwards(compiled):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    backend = TransformersBackend(model, [1, 2, 4], packed=False)
    seqs = [torch.randint(0, 1000, (n,)).numpy() for n in (300, 17, 129, 64)]
    singles = [backend.capture([0], [s]) for s in seqs]
    backend.set_packed(True)
    backend.set_compiled(compiled)
    before = varlen.CALLS["kernel"]
    packed = backend.capture(list(range(4)), seqs)
    assert varlen.CALLS["kernel"] > before, "the varlen kernel did not run"
    assert torch.equal(packed.aux, backend.capture(list(range(4)), seqs).aux)  # same batch, same bits
    for i in range(4):
        a, f = packed.sample(i)
        ra, rf = singles[i].sample(0)
        assert _rel(a, ra) < 2e-2 and _rel(f, rf) < 2e-2, (i, _rel(a, ra), _rel(f, rf))


def test_mla_varlen_kernel_packed_equals_one_sample_forwards():
    """DeepSeek-V3's MLA shape (q/k head dim 192, v 128) through FlashAttention, against
    transformers' own one-sample forwards. In bf16 a router near-tie flips far more often than in
    float32 (1.2% of tokens by the last layer in a CPU bf16 trial of this model), hence 5%."""
    from transformers import AutoModelForCausalLM

    from test_varlen import check_packed_against_singles, random_samples, tiny_mla_config

    cfg = tiny_mla_config(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=64,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        initializer_range=0.02,
    )
    assert varlen_blocker(cfg.to_dict(), "cuda") is None
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    seqs = random_samples([300, 17, 129, 64, 1, 250, 480, 90], cfg.vocab_size)
    layers = [0, 1, 2]
    singles = []
    with torch.no_grad():
        for s in seqs:
            states = model(torch.from_numpy(s)[None].cuda(), output_hidden_states=True).hidden_states
            singles.append((torch.cat([states[k + 1][0] for k in layers], dim=-1), states[-1][0]))
    backend = TransformersBackend(model, layers)
    backend.set_packed(True)
    before = dict(varlen.CALLS)
    packed = backend.capture(list(range(len(seqs))), seqs)
    assert varlen.CALLS["kernel"] - before["kernel"] == cfg.num_hidden_layers
    assert varlen.CALLS["per_sample"] == before["per_sample"], "fell back to per-sample attention"
    check_packed_against_singles(packed, singles, layers, cfg.hidden_size, 3e-2, 0.05, relative=True)


@pytest.mark.parametrize("packing,compile", [("off", "off"), ("off", "on"), ("on", "off"), ("on", "on")])
def test_gpu_extraction_matches_cpu_float32(tmp_path, convs, packing, compile):  # noqa: F811
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    common = dict(model=str(TINY), data=[convs], shard_size=10, batch_tokens=1024)
    gpu_opts = ExtractOptions(out=gpu, device="cuda", dtype="float32", packing=packing, compile=compile, **common)
    extract(gpu_opts, log=lambda m: None)
    extract(ExtractOptions(out=cpu, device="cpu", dtype="float32", packing="off", **common), log=lambda m: None)
    for sid in range(40):
        g = load_file(layout.sample_path(gpu, sid, 10))
        c = load_file(layout.sample_path(cpu, sid, 10))
        assert torch.equal(g["input_ids"], c["input_ids"]) and torch.equal(g["loss_mask"], c["loss_mask"])
        for key in ("aux_hidden_states", "hidden_states"):
            assert (g[key] - c[key]).abs().max().item() < 1e-3, (sid, key)


def test_compiled_run_resumed_in_a_fresh_process_is_byte_identical(tmp_path, convs):  # noqa: F811
    out = tmp_path / "run"
    hsx("extract", "--model", TINY, "--data", convs, "--out", out, "--shard-size", "10", "--batch-tokens", "1024")
    spec = (out / "hsx.json").read_text()
    assert '"compiled": true' in spec and '"packed": true' in spec and '"bfloat16"' in spec  # CUDA defaults
    clean = run_files(out)
    for sid in (1, 12, 30, 31):
        layout.sample_path(out, sid, 10).unlink()
    hsx("extract", "--out", out, env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert run_files(out) == clean


def test_fp8_checkpoint_runs_on_transformers_fp8_kernels(tmp_path, caplog):
    """The tiny block-quantized DeepSeek-V3 of test_checkpoint on the GPU: FP8 layers computing with
    transformers' FP8 kernels (activations quantized to FP8 per block as well, so the states are
    near, not equal to, those of the weights dequantized in float and run in bf16). Where the
    kernels cannot run here (no `kernels` package or no cached kernel offline), the fallback is
    checked instead, dequantized and said so, and the kernel half is skipped with the reason."""
    import logging

    from transformers import AutoModelForCausalLM

    from hsx.capture import checkpoint
    from test_checkpoint import LAYERS, SEQS, fp8_checkpoint, tiny_deepseek

    plain = tiny_deepseek(tmp_path / "plain")
    fp8_checkpoint(plain, tmp_path / "fp8", tmp_path / "reference")
    blocker = checkpoint.fp8_kernel_blocker("cuda")
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        backend = TransformersBackend.load(tmp_path / "fp8", LAYERS, "bfloat16", "cuda")
    notes = " | ".join(r.getMessage() for r in caplog.records)
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.bfloat16).cuda().eval()

    def states(model, ids):
        with torch.no_grad():
            out = model(torch.as_tensor(ids)[None].long().cuda(), output_hidden_states=True)
        return [h[0] for h in out.hidden_states]

    def compare(batch, model, tol):
        for i, ids in enumerate(SEQS):
            ref = states(model, ids)
            aux, final = batch.sample(i)
            for j, k in enumerate(LAYERS):
                assert _rel(aux[:, j * 256 : (j + 1) * 256], ref[k + 1]) < tol, (i, k)
            assert _rel(final, ref[-1]) < tol, i

    batch = backend.capture([0, 1], SEQS)
    if blocker is not None:
        assert "dequantize=True" in notes, notes
        compare(batch, ref_model, 2e-2)
        pytest.skip(f"transformers' FP8 kernels cannot run here: {blocker}")
    from transformers.integrations.finegrained_fp8 import FP8Linear

    assert "FP8 kernels on cuda" in notes, notes
    layer = backend.model.get_submodule("model.layers.0.self_attn.kv_a_proj_with_mqa")
    assert isinstance(layer, FP8Linear) and layer.weight.dtype == torch.float8_e4m3fn and layer.weight.is_cuda
    compare(batch, backend.model, 2e-2)  # hsx's capture = the same FP8 model's own output_hidden_states
    compare(batch, ref_model, 1e-1)  # and near the float dequantization (FP8 activations cost ~1-3%)


# ---------------------------------------------------------------- INT4 routed experts kept packed


def test_int4_expansion_of_a_moonlight_layer_compiled_equals_eager_bit_for_bit():
    """One Moonlight-16B-A3B MoE layer's experts (64, hidden 2048, intermediate 1408), packed by
    compressed-tensors: the compiled (fused) expansion gives the eager expansion's bits."""
    from hsx.capture.quantized import experts, int4

    torch.manual_seed(0)
    fmt = int4.Int4Experts(32)
    stored = {}
    for name, shape in (("gate_up_proj", (64, 2 * 1408, 2048)), ("down_proj", (64, 2048, 1408))):
        q = int4.quantize(torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02, 32)
        assert q["weight_packed"].is_cuda and q["weight_scale"].dtype == torch.bfloat16
        stored[name] = {k: q[k] for k in fmt.stored}
    for dtype in (torch.bfloat16, torch.float32):
        eager = experts._expand(fmt, stored["gate_up_proj"], stored["down_proj"], dtype)
        compiled = experts._compiled_expand(fmt, stored["gate_up_proj"], stored["down_proj"], dtype)
        assert eager[0].shape == (64, 2816, 2048) and eager[1].shape == (64, 2048, 1408)
        for e, c in zip(eager, compiled, strict=True):
            assert c.dtype == dtype and c.is_cuda and torch.equal(e, c)


def test_int4_checkpoint_extracts_on_cuda_as_its_dequantized_model(tmp_path):
    """The Kimi-K2-Thinking-form fixture on CUDA (bf16, packed rows, compiled layers, experts
    expanded per layer by the compiled expansion) against hsx on the same checkpoint with its
    experts dequantized, and against transformers' float32 states of that: within bf16 tolerance,
    a few tokens past it (router near-ties). Not bit for bit: the dequantized model's experts run
    inside the compiled layer, the packed model's outside it (other kernels, other rounding)."""
    from conftest import conversations, save_random, write_jsonl
    from hsx.capture.quantized.experts import stored_modules
    from test_quantized import HIDDEN, kimi_thinking, reference_states, tiny_config

    save_random(tiny_config(), tmp_path / "dense")
    kimi_thinking(tmp_path / "dense", tmp_path / "packed", tmp_path / "reference")
    backend = TransformersBackend.load(tmp_path / "packed", [0, 1], "bfloat16", "cuda")
    held = dict(stored_modules(backend.model))
    assert held and all(m.compiled and m.gate_up_proj__weight_packed.is_cuda for m in held.values())
    del backend
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(8))
    runs = {}
    for name in ("packed", "reference"):
        runs[name] = tmp_path / f"run-{name}"
        opts = ExtractOptions(
            out=runs[name], model=str(tmp_path / name), data=[data], device="cuda", layers=[0, 1], shard_size=8
        )
        assert extract(opts, log=lambda m: None).complete
    assert '"compiled": true' in (runs["packed"] / "hsx.json").read_text()
    files = [load_file(layout.sample_path(runs["packed"], i, 8)) for i in range(8)]
    dequantized = [load_file(layout.sample_path(runs["reference"], i, 8)) for i in range(8)]
    refs = reference_states(tmp_path / "reference", [f["input_ids"].numpy() for f in files])
    float32 = [{"aux_hidden_states": torch.cat(r[1:3], dim=-1), "hidden_states": r[-1]} for r in refs]
    for against in (dequantized, float32):
        far = total = 0
        for f, want in zip(files, against, strict=True):
            assert f["hidden_states"].dtype == torch.bfloat16
            for key in ("aux_hidden_states", "hidden_states"):
                got, ref = f[key].float().view(len(f[key]), -1, HIDDEN), want[key].float().view(len(f[key]), -1, HIDDEN)
                err = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
                far += int((err > 3e-2).sum())
                total += err.numel()
                assert err.median() < 1e-2, (key, err.median())
        assert far <= 0.05 * total, (far, total)  # bf16 router near-ties flip experts for a few tokens
