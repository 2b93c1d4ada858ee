"""GPU-only checks (skipped without CUDA): the varlen kernel and the pinned staging path.

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
from safetensors.torch import load_file

from conftest import TINY, conversations, convs, hsx, run_files, write_jsonl  # noqa: F401  (fixture)
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

    from hsx.spec import load_spec
    from hsx.store.codec import Codec
    from test_codec import _kill_after_new_files, expected_files

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(400))
    args = ("--model", TINY, "--data", data, "--shard-size", "10", "--batch-tokens", "1024", "--writers", "2")
    args += ("--device", "cuda", "--compile", "off")
    raw, out = tmp_path / "raw", tmp_path / "fp8"
    hsx("extract", *args, "--out", raw)
    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    print(f"HSX_CRASH_SEED={seed}")
    k = random.Random(seed).randint(4, 12)
    cmd = [sys.executable, "-m", "hsx", "extract", *map(str, args), "--out", str(out), "--codec", "fp8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_after_new_files(proc, out, k, seed)
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
