"""GPU-only checks (skipped without CUDA): the varlen kernel, the pinned staging path and FP8
checkpoints on torch's block-scaled FP8 GEMM.

The packed path's correctness on CPU is covered by test_capture and test_varlen; here the
FlashAttention kernel itself (eager and with compiled layers, and with MLA's unequal head dims) is
compared with eager one-sample forwards, in bf16, a real extraction through the pinned ring is
compared with float32 CPU states, and a compiled run's resume in a fresh process (compiling again,
no cache) is compared byte for byte. The fp8 codec's encoding on the device (before the copy to the
host) is compared with the CPU encoder every byte, and an fp8 run killed and resumed on the GPU with
the host encoder's files.
"""

import pytest
import torch

from conftest import TINY, conversations, convs, hsx, load_states, run_files, write_jsonl  # noqa: F401  (fixture)
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
        g = load_states(layout.sample_path(gpu, sid, 10))
        c = load_states(layout.sample_path(cpu, sid, 10))
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


# ---------------------------------------------------------------- FP8 checkpoints on torch's block-scaled GEMM

FP8_GEMM = "fp8 route blocked here: {}"


def _fp8_blocker():
    from hsx.capture.quantized import fp8

    return fp8.gemm_blocker("cuda", "bfloat16", [128, 128])


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1000, 4096, 4096),  # whole blocks
        (37, 576, 7168),  # DeepSeek-V3's kv_a_proj_with_mqa: 4.5 row blocks; 37 tokens (cuBLAS wants 4s)
        (77, 512, 384),  # 3 column blocks: the weight's scales padded to 4
        (16, 256, 128),  # 1 column block: scale_a of one column, strides (1, M)
        (5, 320, 192),  # 1.5 column blocks: the weight zero-padded as install pads it
    ],
)
def test_fp8_linear_equals_the_product_of_its_quantized_operands(m, n, k):
    """torch's block-scaled FP8 GEMM against the float64 product of the same quantized operands.
    Bound 4e-3 (relative, Frobenius): the bfloat16 output's rounding (2**-9 relative at most, ~1.1e-3
    rms) plus the Hopper tensor cores' FP8 accumulation within each 128-column block (promoted to
    fp32 between blocks); an H200 gave 1.66e-3 on 4x512x512 to 8192x7168x7168 (torch 2.11). Against
    the unquantized input with the same dequantized weight (the ``dequantized`` route's product)
    the error is e4m3's, 1-5%. Compiled (the quantization fused, the GEMM an opaque op, dynamic
    shapes, no graph break): the same bits as eager."""
    from hsx.capture.quantized import fp8
    from test_fp8 import blocks64, quantize_blocks, reference

    if (blocker := _fp8_blocker()) is not None:
        pytest.skip(FP8_GEMM.format(blocker))
    torch.manual_seed(m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    weight, scale = (t.cuda() for t in quantize_blocks(torch.randn(n, k) * 0.05))
    padded = torch.nn.functional.pad(weight.view(torch.uint8), (0, -k % 128)).view(torch.float8_e4m3fn)
    out = fp8.fp8_linear(x, padded, scale)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    values, scales = fp8.quantize_activations(torch.nn.functional.pad(x, (0, -k % 128)))
    exact = reference(values.cpu(), scales.cpu(), padded.cpu(), scale.cpu())
    assert _rel(out.cpu(), exact) < 4e-3, _rel(out.cpu(), exact)
    dequantized = x.cpu().double() @ blocks64(weight.cpu(), scale.cpu()).t()
    assert 5e-3 < _rel(out.cpu(), dequantized) < 5e-2
    compiled = torch.compile(fp8.fp8_linear, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(x, padded, scale), out)
    half = x[: max(1, m // 2)]  # another token count, the same compiled graph
    assert torch.equal(compiled(half, padded, scale), fp8.fp8_linear(half, padded, scale))


@pytest.mark.parametrize(
    "m,k",
    [
        (16384, 4096),  # whole programs; a large batch's row offsets
        (37, 7168),  # tokens padded to 48: zero rows, unit scales
        (1, 128),  # one token, one column block
        (1000, 384),
    ],
)
def test_quantization_kernel_is_the_reference_bit_for_bit(m, k):
    """The Triton kernel's GEMM operand against ``quantize_activations`` and ``activation_operands``
    in torch (eager): every e4m3 byte and every scale equal, the padding included. The input mixes
    magnitudes 1e-30 to 1e30 per 128-column group (values in e4m3's subnormal range after
    scaling, and amaxes under the 1e-12 floor), groups of zeros, and bfloat16's largest values."""
    from hsx.capture.quantized import fp8, fp8_kernel

    if (blocker := _fp8_blocker()) is not None:
        pytest.skip(FP8_GEMM.format(blocker))
    torch.manual_seed(k)
    groups = k // 128
    magnitude = 10.0 ** torch.randint(-30, 31, (m, groups, 1)).float()
    x = (torch.randn(m, groups, 128) * magnitude * torch.rand(m, groups, 128) ** 8).flatten(1)
    x[::7, :128] = 0  # groups of zeros
    x[::5, -1] = torch.finfo(torch.bfloat16).max
    x = x.to(torch.bfloat16).cuda()
    values, scales = fp8_kernel.activation_operands(x, fp8.TOKEN_MULTIPLE)
    want_values, want_scales = fp8.activation_operands(*fp8.quantize_activations(x))
    assert values.shape == want_values.shape == (m + -m % 16, k) and values.dtype == torch.float8_e4m3fn
    assert scales.shape == want_scales.shape and scales.stride() == want_scales.stride() == (1, m + -m % 16)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    strided = torch.zeros(m, k + 256, dtype=torch.bfloat16, device="cuda")[:, 64 : 64 + k]
    strided.copy_(x)  # a view with a row stride wider than its columns
    assert torch.equal(
        fp8_kernel.activation_operands(strided, fp8.TOKEN_MULTIPLE)[0].view(torch.uint8), values.view(torch.uint8)
    )


def test_scaled_grouped_mm_with_block_scales():
    """Whether torch offers a grouped FP8 GEMM with DeepSeek's block scales (routed experts could run
    on it instead of being expanded): skipped with torch's own words where it does not (torch
    2.11 on an H200: scaled_grouped_mm 'No gemm implementation was found', _scaled_grouped_mm
    takes 1-D row-wise scales only); where it does, checked against the per-expert products."""
    from hsx.capture.quantized import fp8
    from test_fp8 import quantize_blocks, reference

    if (blocker := _fp8_blocker()) is not None:
        pytest.skip(FP8_GEMM.format(blocker))
    from torch.nn.functional import ScalingType

    torch.manual_seed(0)
    groups, m, n, k = 4, 64, 256, 512
    values, scales = fp8.quantize_activations(torch.randn(groups * m, k, device="cuda"))
    stored = [quantize_blocks(torch.randn(n, k) * 0.05) for _ in range(groups)]
    weights = torch.stack([w for w, _ in stored]).cuda()
    weight_scales = torch.stack([s for _, s in stored]).cuda()
    offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * m
    scale_a = torch.empty_strided(scales.shape, (1, scales.shape[0]), device="cuda")
    scale_a.copy_(scales)
    try:
        out = torch.nn.functional.scaled_grouped_mm(
            values,
            weights.transpose(-2, -1),
            scale_a,
            ScalingType.BlockWise1x128,
            weight_scales.transpose(-2, -1),
            ScalingType.BlockWise128x128,
            offs=offsets,
            output_dtype=torch.bfloat16,
        )
    except (RuntimeError, ValueError, NotImplementedError, TypeError, AttributeError) as e:
        pytest.skip(f"torch {torch.__version__}: no grouped FP8 GEMM with 1x128/128x128 block scales ({e})")
    for g in range(groups):
        rows = slice(g * m, (g + 1) * m)
        want = reference(values[rows].cpu(), scales[rows].cpu(), weights[g].cpu(), weight_scales[g].cpu())
        assert _rel(out[rows].cpu(), want) < 4e-3, g


def _fp8_deepseek(tmp_path):
    """The tiny block-quantized DeepSeek-V3 of test_checkpoint (weights of 1.5 blocks, as DeepSeek-V3's
    576-row kv_a_proj_with_mqa is 4.5), with the bundled tokenizer for hsx extract, and its float
    dequantization (the reference)."""
    import shutil

    from conftest import TINY
    from test_checkpoint import fp8_checkpoint, tiny_deepseek

    plain = tiny_deepseek(tmp_path / "plain")
    fp8_checkpoint(plain, tmp_path / "fp8", tmp_path / "reference")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / name, tmp_path / "fp8" / name)
    return tmp_path / "fp8", tmp_path / "reference"


@pytest.mark.parametrize("packed,compiled", [(False, False), (True, True)])
def test_fp8_checkpoint_runs_on_torchs_fp8_gemm(tmp_path, caplog, packed, compiled):
    """The tiny FP8 DeepSeek-V3 on the GPU with the default quantized compute (fp8): FP8 weights kept
    (experts too), no transformers FP8 kernel, hsx's capture = the same model's own
    output_hidden_states, and near the float dequantization run in bf16 (e4m3 activations: 3.9-6.4%
    median per token after 1-3 layers of this random model on an H200, as on CPU with the emulated
    GEMM; router near-ties counted, at most 20% of a sample's tokens beyond 12%)."""
    import logging

    from transformers import AutoModelForCausalLM
    from transformers.integrations import finegrained_fp8 as hf

    from test_checkpoint import LAYERS, SEQS

    if (blocker := _fp8_blocker()) is not None:
        pytest.skip(FP8_GEMM.format(blocker))
    fp8_dir, reference_dir = _fp8_deepseek(tmp_path)
    loaded = []
    original = hf.load_finegrained_fp8_kernel
    hf.load_finegrained_fp8_kernel = lambda: loaded.append(1) or original()
    try:
        with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
            backend = TransformersBackend.load(fp8_dir, LAYERS, "bfloat16", "cuda", packed=packed, compiled=compiled)
        batch = backend.capture([0, 1], SEQS)
    finally:
        hf.load_finegrained_fp8_kernel = original
    assert not loaded, "transformers' Hub kernel was asked for"
    notes = " | ".join(r.getMessage() for r in caplog.records)
    assert "quantized compute fp8" in notes and "24 FP8 linear layers on torch's block-scaled FP8 GEMM" in notes, notes
    model = backend.model
    layer = model.get_submodule("model.layers.0.self_attn.kv_a_proj_with_mqa")
    assert isinstance(layer, hf.FP8Linear) and layer.weight.dtype == torch.float8_e4m3fn and layer.weight.is_cuda
    assert model.model.layers[1].mlp.experts.down_proj.dtype == torch.float8_e4m3fn
    ref_model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.bfloat16).cuda().eval()

    def states(m, ids):
        with torch.no_grad():
            out = m(torch.as_tensor(ids)[None].long().cuda(), output_hidden_states=True)
        return [h[0].float() for h in out.hidden_states]

    def token_errors(got, want):
        return (got.float() - want).norm(dim=-1) / want.norm(dim=-1)

    backend.set_packed(False)  # the model's own forward: one padded row, eager
    backend.set_compiled(False)
    for i, ids in enumerate(SEQS):
        aux, final = batch.sample(i)
        own, ref = states(model, ids), states(ref_model, ids)
        for got, k in [*((aux[:, j * 256 : (j + 1) * 256], k + 1) for j, k in enumerate(LAYERS)), (final, -1)]:
            # the same FP8 model's own forward: the same computation unpacked and eager (0 measured);
            # packed and compiled, the bf16 noise of packed attention moves activations across e4m3
            # rounding steps, which makes differences of FP8's own size (3.5-5% medians measured
            # on an H200) and flips near-tie router choices (counted)
            errors = token_errors(got, own[k])
            assert errors.median() < (0.07 if packed else 1e-3), (i, k, errors.median())
            assert (errors > 0.12).float().mean() <= 0.2, (i, k, errors)
            errors = token_errors(got, ref[k])  # the float dequantization: e4m3 activations
            assert (errors > 0.12).float().mean() <= 0.2, (i, k, errors)
            assert 0.01 < errors.median() < 0.08, (i, k, errors.median())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_encoded_on_the_device_is_the_host_encoders_file(dtype):
    """Every byte: the fp8 quantization on the GPU equals the CPU's on hard states (zero rows,
    subnormals, a subnormal scale, the dtype's largest values, inf and NaN of any sign and payload)
    and on a large random block (several device steps); and the pinned ring with fp8 slots (encoded
    on its side stream, then copied) hands the writer states whose files are the host encoder's."""
    from hsx.staging import staging_for
    from hsx.store.codec import Codec, Encoded, quantize_fp8
    from test_codec import COLS, GROUPS, check_staged_equals_host, hard_batch, hard_states

    x = hard_states(4096, dtype, seed=3)
    big = (torch.randn(12_000, 3 * 4096) * torch.exp(2 * torch.randn(12_000, 1))).to(dtype)
    for states, groups in ((x, GROUPS), (big, 3)):
        on_device, on_host = quantize_fp8(states.cuda(), groups), quantize_fp8(states, groups)
        assert all(torch.equal(_bits(d), _bits(h)) for d, h in zip(on_device, on_host, strict=True))
    del big, on_device, on_host

    batch = hard_batch(dtype, "cuda")
    staging = staging_for(torch.device("cuda"), dtype, COLS, 32, 64, 1 << 20, Codec.FP8)
    assert staging.encodes is Codec.FP8
    for wanted in ([0, 1, 2, 3], [1, 3], [2]):
        host = staging.stage(batch, wanted)
        host.ready()
        for aux, final in host.views:
            assert isinstance(aux, Encoded) and isinstance(final, Encoded)
            assert all(t.device.type == "cpu" and t.is_pinned() for t in aux.tensors + final.tensors)
        check_staged_equals_host(batch, host.views, wanted, Codec.FP8)
        for _ in wanted:
            host.done_one()
    staging.close()


def test_fp8_run_killed_and_resumed_on_the_gpu_is_the_host_encoders_bytes(tmp_path):
    """An fp8 run on CUDA (its states quantized on the device) is killed (kill -9) once k new files
    exist, then resumed: every file is byte for byte what the host encoder makes of the states of a
    raw CUDA run of the same data (same batches, same bits)."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    from conftest import kill_after_new_files
    from hsx.spec import load_spec
    from hsx.store.codec import Codec
    from test_codec import expected_files

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(400))
    args = ("--model", TINY, "--data", data, "--shard-size", "10", "--batch-tokens", "1024", "--writers", "2")
    args += ("--device", "cuda", "--compile", "off")
    raw, out = tmp_path / "raw", tmp_path / "fp8"
    hsx("extract", *args, "--out", raw, "--codec", "raw")
    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    print(f"HSX_CRASH_SEED={seed}")
    k = random.Random(seed).randint(4, 12)
    cmd = [sys.executable, "-m", "hsx", "extract", *map(str, args), "--out", str(out), "--codec", "fp8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after_new_files(proc, out, k, seed)
    assert proc.returncode == -signal.SIGKILL, f"seed {seed}: the kill did not land mid-run"
    assert k <= len(run_files(out)) < 400, f"seed {seed}: the kill came after the run had finished"
    assert load_spec(out).codec is Codec.FP8
    hsx("extract", "--out", out)
    assert run_files(out) == expected_files(raw, Codec.FP8), f"seed {seed}"


def test_bench_on_cuda_measures_fp8_encoded_on_the_device(tmp_path):
    """`hsx bench` on the GPU (the tiny model, few samples): the fp8 row is the device-encoded path,
    zstd's the host's, beside raw on the same batches."""
    args = ("--device", "cuda", "--model", TINY, "--samples", "12", "--mean-len", "40", "--min-len", "8")
    args += ("--max-len", "96", "--batch-tokens", "256", "--naive-samples", "0", "--compile", "off")
    proc = hsx("bench", *args, "--workdir", tmp_path)
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("codec  stored/raw"))
    codecs = {line.split()[0]: line.split()[1:] for line in lines[at + 1 : at + 4]}
    assert list(codecs) == ["raw", "zstd", "fp8"] and [v[-1] for v in codecs.values()] == ["-", "host", "device"]
    assert 0.25 < float(codecs["fp8"][0]) < 0.75 and float(codecs["zstd"][0]) < 1  # headers weigh on tiny files


def test_fp8_checkpoint_extraction_resumes_after_kill9_byte_identically(tmp_path):
    """hsx extract of the tiny FP8 DeepSeek-V3 with CUDA's defaults (bf16, packed, compiled, quantized
    compute fp8 and its activations' quantization, recorded in the spec); killed -9 twice after it
    wrote files, resumed: the same bytes as an uninterrupted run. A resume asking for the other
    compute is refused by name."""
    import json
    import signal
    import subprocess
    import sys

    from conftest import conversations, kill_after_new_files, write_jsonl
    from hsx.spec import FP8_ACTIVATIONS

    if (blocker := _fp8_blocker()) is not None:
        pytest.skip(FP8_GEMM.format(blocker))
    fp8_dir, _ = _fp8_deepseek(tmp_path)
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(60, start=100))
    args = ["extract", "--model", fp8_dir, "--data", data, "--shard-size", "10", "--batch-tokens", "512"]
    hsx(*args, "--out", tmp_path / "whole")
    spec = json.loads((tmp_path / "whole" / "hsx.json").read_text())
    assert spec["quantized_compute"] == "fp8" and spec["compiled"] and spec["dtype"] == "bfloat16"
    assert spec["fp8_activations"] == FP8_ACTIVATIONS  # the kernel's roundings: a resume under others is refused
    reference = run_files(tmp_path / "whole")
    assert len(reference) == 60
    out = tmp_path / "crashed"
    for _ in range(2):
        cmd = [sys.executable, "-m", "hsx", *map(str, args), "--out", str(out)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kill_after_new_files(proc, out, 8, seed=0)
        assert proc.returncode == -signal.SIGKILL and len(run_files(out)) < 60
    refused = hsx("extract", "--out", out, "--quantized-compute", "dequantized", check=False)
    assert (
        refused.returncode != 0
        and "quantized compute: run has fp8, asked for dequantized" in refused.stdout + refused.stderr
    )
    hsx("extract", "--out", out)
    assert run_files(out) == reference


def test_fp8_tensor_parallel_layouts_are_refused_where_blocks_split(tmp_path):
    """transformers' TP plans split the MLPs' intermediate dimension; FP8 weights split there keep
    their scales only where each rank's share is whole 128-row blocks. The tiny model's 384
    (3 blocks) over 2 ranks is refused by name for fp8 (and falls back to dequantized by default,
    as on CPU); a whole-block layout runs where this machine has the GPUs (test_parallel's TP runs)."""
    from hsx.capture import checkpoint
    from hsx.errors import OptionError
    from hsx.extract.options import resolve_quantized_compute
    from hsx.spec import Parallel

    if (blocker := _fp8_blocker()) is not None:
        pytest.skip(FP8_GEMM.format(blocker))
    fp8_dir, _ = _fp8_deepseek(tmp_path)
    said = []
    with pytest.raises(OptionError, match="intermediate_size 384 over 2 ranks is not whole 128-row blocks"):
        resolve_quantized_compute("fp8", fp8_dir, "cuda", "bfloat16", Parallel(tensor=2, expert=2), said.append)
    assert (
        resolve_quantized_compute(None, fp8_dir, "cuda", "bfloat16", Parallel(tensor=2), said.append) == "dequantized"
    )
    assert "intermediate_size 384 over 2 ranks" in said[-1]
    assert resolve_quantized_compute(None, fp8_dir, "cuda", "bfloat16", Parallel(), said.append) == "fp8"
    assert checkpoint.compute_choice(fp8_dir, "cuda", "float32", None) == (
        "dequantized",
        "the block-scaled FP8 GEMM writes bfloat16, the run's dtype is float32",
    )


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
        compiled = experts._compiled_expand()(fmt, stored["gate_up_proj"], stored["down_proj"], dtype)
        assert eager[0].shape == (64, 2816, 2048) and eager[1].shape == (64, 2048, 1408)
        for e, c in zip(eager, compiled, strict=True):
            assert c.dtype == dtype and c.is_cuda and torch.equal(e, c)


@pytest.mark.parametrize(
    ("experts", "n", "k"),
    [(6, 2 * 1408, 2048), (6, 2048, 1408), (4, 2 * 2048, 7168), (4, 7168, 2048)],
    ids=["moonlight-gate-up", "moonlight-down", "kimi-gate-up", "kimi-down"],
)
def test_int4_dequantizing_gemm_is_the_expanded_weights_product_rounded_once(experts, n, k):
    """The dequantizing grouped GEMM (Triton, compiled) in bfloat16 on a Moonlight and a Kimi-K2.5
    layer's projections, experts given no row, one, and hundreds: each value is the expanded
    weights' exact product (float64) rounded once, or the value next to it give or take a float32
    sum's own error; nearly all of them exactly."""
    from hsx.capture.quantized import int4, int4_kernel
    from test_int4_kernel import beyond_one_rounding, exact_product

    torch.manual_seed(0)
    stored = int4.quantize(torch.randn(experts, n, k, dtype=torch.bfloat16, device="cuda") * 0.02, 32)
    counts = [0, 1, 300, 77, 129, 64][:experts]
    x = torch.randn(sum(counts), k, dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    out = int4_kernel.grouped_linear(x, int4_kernel.Packed.of(stored, 32), offsets)
    exact, magnitude = exact_product(x, int4.Int4Experts(32).expand(stored, torch.bfloat16), counts)
    assert beyond_one_rounding(out, exact, magnitude, k) == 0
    same = int((out == exact.to(out.dtype)).sum())
    assert same >= 0.99 * out.numel(), f"{same} of {out.numel()} values are the exact product rounded"


def test_int4_moe_model_on_the_dequantizing_gemm_computes_its_expanded_experts_states():
    """The tiny DeepSeek-V3 of test_int4_kernel in bfloat16 on CUDA: on the kernel, nothing expanded,
    against the experts expanded for transformers' grouped_mm (cuBLAS): the states agree but for
    another GEMM's float32 sums, near-tie flips counted and bounded."""
    from test_int4_kernel import beyond_tolerance, moe_states

    calls = []
    expanded, fused = moe_states("cuda", torch.bfloat16, calls)
    assert len(calls) == 2 * 2
    beyond_tolerance(expanded, fused, tight=1e-2, flip=5e-2, share=0.05)


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
    files = [load_states(layout.sample_path(runs["packed"], i, 8)) for i in range(8)]
    dequantized = [load_states(layout.sample_path(runs["reference"], i, 8)) for i in range(8)]
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
