"""Routed experts kept INT4-packed (hsx.capture.quantized): the Kimi-K2-Thinking form (model type
kimi_k2, architecture DeepseekV3ForCausalLM, ``auto_map`` to the repository's code, compressed-tensors
pack-quantized INT4 group 32 on the routed experts only), a tiny DeepSeek-V3 the tests build and
pack with compressed-tensors' own compressor. The reference is transformers' native
DeepseekV3ForCausalLM on the same weights with the experts dequantized by compressed-tensors' own
unpack + dequantize, in float32.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY, conversations, hsx, require, run_files, save_random, verified_files, write_jsonl
from hsx.capture.quantized import experts as jit
from hsx.capture.quantized import int4
from hsx.capture.transformers import TransformersBackend

require("compressed_tensors")  # CI names it in HSX_REQUIRE: missing there is a failure, not a skip

VOCAB = 2048  # the bundled tokenizer's
HIDDEN = 64
LAYERS = [0, 1]  # hidden_states[3] of 3 layers is after the final norm: the final state
EXPERT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def tiny_config(**over):
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
    )  # fmt: skip
    return DeepseekV3Config(**(kw | over))


def dequantized(stored: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    """compressed-tensors' own unpacking and dequantization of one stored projection, in ``dtype``."""
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    values = unpack_from_int32(stored["weight_packed"], 4, stored["weight_shape"])
    return dequantize(values, stored["weight_scale"].to(dtype), args=args, dtype=dtype)


def kimi_thinking(dense: Path, packed: Path, reference: Path) -> None:
    """From a float32 checkpoint: ``packed`` in the Kimi-K2-Thinking form (bf16 weights, routed experts
    INT4-packed by compressed-tensors), ``reference`` the same weights with the experts dequantized
    (float32, plain DeepSeek-V3)."""
    for path in (packed, reference):
        path.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TINY / name, path / name)
    stored, ref = {}, {}
    for name, t in load_file(dense / "model.safetensors").items():
        t = t.to(torch.bfloat16) if "e_score_correction_bias" not in name else t
        if EXPERT.search(name):
            q = int4.quantize(t, 32)
            for key, value in q.items():
                stored[f"{name.removesuffix('.weight')}.{key}"] = value
            ref[name] = dequantized(q)
        else:
            stored[name], ref[name] = t, t.to(torch.float32)
    save_file(stored, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(ref, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps(config))
    config |= {
        "model_type": "kimi_k2",
        "auto_map": {
            "AutoConfig": "configuration_kimi_k2.KimiK2Config",
            "AutoModel": "modeling_kimi_k2.KimiK2Model",
            "AutoModelForCausalLM": "modeling_kimi_k2.KimiK2ForCausalLM",
        },
        "quantization_config": int4.quantization_config(32),
    }
    (packed / "config.json").write_text(json.dumps(config))
    (packed / "modeling_kimi_k2.py").write_text("raise RuntimeError('the repository modeling code ran')\n")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The Kimi-K2-Thinking form (``packed``, its reference ``reference``) and the Kimi-K2.5
    composite (``kimi-int4``: quantization config inside text_config, vision weights beside the
    language model; its reference ``int4-reference``)."""
    from kimi_fixtures import kimi_k25_int4, language_model_reference

    root = tmp_path_factory.mktemp("int4")
    save_random(tiny_config(), root / "dense")
    kimi_thinking(root / "dense", root / "packed", root / "reference")
    kimi_k25_int4(language_model_reference(root / "lm"), root / "kimi-int4", root / "int4-reference")
    return {p.name: p for p in root.iterdir()}


REFERENCE = {"packed": "reference", "kimi-int4": "int4-reference"}  # each INT4 checkpoint's dequantized model


SEQS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).numpy() for n in (23, 9, 40)]


def reference_states(model_dir: Path, seqs) -> list[list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    with torch.no_grad():
        return [
            [h[0] for h in model(torch.as_tensor(s)[None].long(), output_hidden_states=True).hidden_states]
            for s in seqs
        ]


def states(backend, seqs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batch = backend.capture(list(range(len(seqs))), seqs)
    return [tuple(t.clone() for t in batch.sample(i)) for i in range(len(seqs))]


# ---------------------------------------------------------------- the expansion


def test_expansion_is_compressed_tensors_dequantization_exactly():
    w = torch.randn(3, 96, 128, dtype=torch.bfloat16)
    q = int4.quantize(w, 32)
    assert q["weight_packed"].dtype == torch.int32 and q["weight_packed"].shape == (3, 96, 16)
    assert q["weight_scale"].shape == (3, 96, 4)
    fmt = int4.Int4Experts(32)
    for dtype in (torch.float32, torch.bfloat16):
        got = fmt.expand(q, dtype)
        ref = torch.stack([dequantized({k: v[e] for k, v in q.items()}, torch.float32) for e in range(3)]).to(dtype)
        assert got.dtype == dtype and torch.equal(got, ref)
    assert (fmt.expand(q, torch.float32) - w.float()).abs().max() <= q[
        "weight_scale"
    ].float().max()  # a real round trip


# ---------------------------------------------------------------- one process, float32


def test_packed_float32_run_equals_the_dequantized_model(models, caplog):
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        backend = TransformersBackend.load(models["packed"], LAYERS, "float32", "cpu")
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "stay packed" in said and "int4-packed, expanded per layer to float32" in said, said
    refs = reference_states(models["reference"], SEQS)
    for (aux, final), ref in zip(states(backend, SEQS), refs, strict=True):
        for j, k in enumerate(LAYERS):
            assert (aux[:, j * HIDDEN : (j + 1) * HIDDEN] - ref[k + 1]).abs().max() <= 1e-5
        assert (final - ref[-1]).abs().max() <= 1e-5
    # hsx on the dequantized checkpoint: the same bits
    plain = TransformersBackend.load(models["reference"], LAYERS, "float32", "cpu")
    for (a, f), (ra, rf) in zip(states(backend, SEQS), states(plain, SEQS), strict=True):
        assert torch.equal(a, ra) and torch.equal(f, rf)


# ---------------------------------------------------------------- memory: packed at rest, one layer expanded


def test_experts_are_held_packed_and_one_layer_is_expanded_at_a_time(models, monkeypatch):
    backend = TransformersBackend.load(models["packed"], LAYERS, "float32", "cpu")
    held = dict(jit.stored_modules(backend.model))
    assert sorted(held) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    for m in held.values():
        assert not list(m.parameters(recurse=False)), "no dense expert parameters"
        assert m.gate_up_proj__weight_packed.dtype == torch.int32
        assert m.gate_up_proj__weight_packed.shape == (8, 2 * 64, HIDDEN // 8)
        assert m.gate_up_proj__weight_scale.shape == (8, 2 * 64, HIDDEN // 32)
        assert m.gate_up_proj__weight_scale.dtype == torch.bfloat16  # as stored
        assert m.down_proj__weight_packed.shape == (8, HIDDEN, 64 // 8)
        assert "gate_up_proj" not in vars(m) and "down_proj" not in vars(m)
    dense = 2 * 8 * 3 * 64 * HIDDEN * 4  # two MoE layers, float32
    assert jit.stored_bytes(backend.model) == 2 * 8 * 3 * 64 * (HIDDEN // 8 * 4 + HIDDEN // 32 * 2)
    assert jit.stored_bytes(backend.model) < 0.2 * dense
    alive: list[weakref.ref] = []
    calls = []
    expand = jit.StoredExperts.expand

    def watched(self):
        assert all(r() is None for r in alive), "an earlier layer's expansion is still alive"
        out = expand(self)
        assert all(t.dtype == torch.float32 for t in out)
        alive.extend(weakref.ref(t) for t in out)
        calls.append(self)
        return out

    monkeypatch.setattr(jit.StoredExperts, "expand", watched)
    states(backend, SEQS)
    assert [id(m) for m in calls] == [id(m) for m in held.values()]  # each MoE layer once, in order
    assert all(r() is None for r in alive)


@pytest.mark.parametrize("name", ["packed", "kimi-int4"])
def test_an_ep_rank_reads_only_its_own_experts(models, name):
    """Rank 1 of 2 holds the second half of the experts, exactly the checkpoint's packed values and
    scales (the composite's read under its language model's prefix), and nothing of the others."""
    from transformers import DeepseekV3ForCausalLM

    from hsx import target
    from hsx.capture import checkpoint

    path = models[name]
    how = checkpoint.plan(path, "cpu", "float32")
    with jit.swapped(DeepseekV3ForCausalLM, how.experts, torch.float32, ep_rank=1, ep_size=2):
        model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, **how.kwargs())
    prefix = target.LanguageModel.of(path).prefix
    jit.fill(model, path, torch.device("cpu"), prefix)
    stored = {}
    for shard in sorted(path.glob("*.safetensors")):
        stored |= load_file(shard)
    n = model.config.n_routed_experts // 2
    experts = model.model.layers[2].mlp.experts
    assert experts.num_experts == n and experts.first_expert == n
    for key, t in experts.named_buffers():
        assert t.shape[0] == n, key  # only this rank's experts, packed values and scales
    for local, e in enumerate(range(n, 2 * n)):
        expert = f"{prefix}model.layers.2.mlp.experts.{e}"
        gate_up = torch.cat([stored[f"{expert}.gate_proj.weight_packed"], stored[f"{expert}.up_proj.weight_packed"]])
        assert torch.equal(experts.gate_up_proj__weight_packed[local], gate_up)
        assert torch.equal(experts.down_proj__weight_scale[local], stored[f"{expert}.down_proj.weight_scale"])


def test_spec_records_the_experts_held_packed(models):
    from hsx import target

    identity = target.identity(str(models["packed"]), models["packed"])
    assert identity.quantization.method == "compressed-tensors"
    assert identity.quantization.experts == "int4-packed group 32"
    assert "routed experts int4-packed group 32, expanded per layer" in str(identity.quantization)
    assert target.identity(str(models["reference"]), models["reference"]).quantization is None


def test_the_compute_choices_of_int4_packed_experts(models):
    """INT4-packed experts expand per layer unless a run asks for the dequantizing GEMM
    (``--quantized-compute int4``, test_int4_kernel) or says ``dequantized`` (the same path, named);
    fp8 is refused by name."""
    from hsx.capture import checkpoint
    from hsx.errors import OptionError

    for name in ("packed", "kimi-int4"):
        assert checkpoint.compute_choice(models[name], "cpu", "float32", None) == (None, None)
        assert checkpoint.compute_choice(models[name], "cpu", "float32", "dequantized") == ("dequantized", None)
        with pytest.raises(OptionError, match=r"quantized-compute fp8 applies to FP8 checkpoints; .* experts are INT4"):
            checkpoint.compute_choice(models[name], "cuda", "bfloat16", "fp8")
        with pytest.raises(OptionError, match=r"--quantized-compute int4 cannot run here: .*float32"):
            checkpoint.compute_choice(models[name], "cuda", "float32", "int4")


# ---------------------------------------------------------------- a slice of experts at a time


def sliced_model(fmt, implementation: str, dtype: torch.dtype):
    """A tiny DeepSeek-V3 (16 experts, top 4: a token's outputs are added in an order that shows)
    with its routed experts held as ``fmt`` stores them (INT4 packed, or dense)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(n_routed_experts=16, num_experts_per_tok=4)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.set_experts_implementation(implementation)
    quantize = (lambda w: int4.quantize(w, 32)) if fmt.name == int4.NAME else (lambda w: {"weight": w})
    jit.from_dense(model, fmt, quantize)
    return model


def forward_states(model, slice_bytes: int | None) -> list[torch.Tensor]:
    for _, module in jit.stored_modules(model):
        module.slice_bytes = slice_bytes
    with torch.no_grad():
        return [
            torch.stack(model(torch.as_tensor(s)[None].long(), output_hidden_states=True).hidden_states) for s in SEQS
        ]


@pytest.mark.parametrize(
    ("fmt", "implementation", "dtype"),
    [
        (int4.Int4Experts(32), "grouped_mm", torch.bfloat16),
        (int4.Int4Experts(32), "grouped_mm", torch.float32),
        (int4.Int4Experts(32), "eager", torch.float32),
        (jit.DENSE, "grouped_mm", torch.bfloat16),
        (jit.DENSE, "eager", torch.bfloat16),
    ],
    ids=["int4-grouped-bf16", "int4-grouped-f32", "int4-eager-f32", "dense-grouped-bf16", "dense-eager-bf16"],
)
def test_experts_expanded_a_slice_at_a_time_give_the_whole_layers_bits(fmt, implementation, dtype, monkeypatch):
    """Under a budget of one expert, and of three (the last slice short), no whole layer is ever
    expanded, no slice is over its budget, and every state equals the whole-layer expansion's bit for
    bit (each of the experts functions hsx slices, whose ways of stacking a GEMM's rows and adding a
    token's pairs differ; float32 on CPU shows a row computed in another order)."""
    model = sliced_model(fmt, implementation, dtype)
    whole = forward_states(model, None)
    one = jit.expert_bytes(next(m for _, m in jit.stored_modules(model)), dtype)
    assert one == 3 * 64 * HIDDEN * dtype.itemsize
    sizes = []
    expand_slice = jit.StoredExperts.expand_slice

    def watched(self, experts):
        out = expand_slice(self, experts)
        sizes.append(out["gate_up_proj"].shape[0])
        return out

    monkeypatch.setattr(jit.StoredExperts, "expand", lambda self: pytest.fail("a whole layer was expanded"))
    monkeypatch.setattr(jit.StoredExperts, "expand_slice", watched)
    monkeypatch.setattr(jit, "COMBINED", 7)  # the pairs added 7 tokens at a time, the last chunk short
    for budget, most in ((one, 1), (3 * one + one // 2, 3)):
        sizes.clear()
        got = forward_states(model, budget)
        assert sizes and max(sizes) == most and len(sizes) >= 16 // most, sizes
        for a, b in zip(got, whole, strict=True):
            assert torch.equal(a, b)
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(forward_states(model, 16 * one), whole, strict=True))


def test_an_experts_function_the_slices_cannot_reproduce_is_refused():
    """batched_mm's one batched product of every pair gives some pairs other float32 bits than a
    slice's batch: a budget on it is refused by name when set, before anything runs."""
    from hsx.errors import UnsupportedModel

    model = sliced_model(int4.Int4Experts(32), "batched_mm", torch.float32)
    with pytest.raises(
        UnsupportedModel, match="run transformers' 'batched_mm'; a slice at a time runs grouped_mm and eager only"
    ):
        jit.set_slice(model, 10**6, torch.float32)


def test_an_ep_ranks_slices_give_its_whole_layers_partial_sum():
    """EP2: each rank's share of the experts, sliced, gives the rank's partial output of the whole
    layer bit for bit (what the group's all-reduce adds; here a group of one process), routes to the
    other rank's experts adding nothing, as they do there."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(n_routed_experts=16, num_experts_per_tok=4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    dense = model.model.layers[1].mlp.experts
    fmt = int4.Int4Experts(32)
    hidden = torch.randn(97, HIDDEN, dtype=torch.bfloat16)
    routed = torch.stack([torch.randperm(16)[:4] for _ in range(97)])
    weights = torch.rand(97, 4)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        partial = []
        for rank in (0, 1):
            cls = jit.stored_class(type(dense), fmt, torch.bfloat16, ep_rank=rank, ep_size=2)
            experts = cls(config)
            for fused in jit.PROJECTIONS:
                experts.set_stored(fused, int4.quantize(getattr(dense, fused).detach()[rank * 8 : rank * 8 + 8], 32))
            with torch.no_grad():
                whole = experts(hidden, routed, weights)
                experts.slice_bytes = 3 * jit.expert_bytes(experts, torch.bfloat16)
                assert jit.per_slice(experts, experts.slice_bytes, torch.bfloat16) == 3
                assert torch.equal(experts(hidden, routed, weights), whole)
            partial.append(whole)
    finally:
        dist.destroy_process_group()
    assert all(p.abs().sum() > 0 for p in partial)


def test_a_run_given_an_expert_slice_writes_the_whole_layers_files_and_records_it(models, tmp_path, caplog):
    """``--expert-slice-gb`` (two of the 8 experts at a time here): the same sample files byte for
    byte as the run that expands each layer whole, the budget in the spec and the log, and a
    resume asking for another budget refused by name."""
    from hsx.errors import OptionError, Refused
    from hsx.extract import ExtractOptions, extract

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(6, start=400))
    common = dict(model=str(models["packed"]), data=[data], device="cpu", layers=LAYERS, shard_size=3, writers=1)
    assert extract(ExtractOptions(out=tmp_path / "whole", **common), log=lambda m: None).complete
    budget = 2.5 * 3 * 64 * HIDDEN * 4 / 1e9  # two and a half float32 experts
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        opts = ExtractOptions(out=tmp_path / "sliced", expert_slice_gb=budget, **common)
        assert extract(opts, log=lambda m: None).complete
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "routed experts expanded 2 of a MoE layer's 8 at a time" in said, said
    assert run_files(tmp_path / "sliced") == run_files(tmp_path / "whole")
    assert json.loads((tmp_path / "sliced" / "hsx.json").read_text())["expert_slice_gb"] == budget
    assert "expert_slice_gb" not in json.loads((tmp_path / "whole" / "hsx.json").read_text())
    with pytest.raises(Refused, match=f"expert slice gb: run has {budget}, asked for 0.5"):
        extract(ExtractOptions(out=tmp_path / "sliced", expert_slice_gb=0.5, **common), log=lambda m: None)
    with pytest.raises(OptionError, match="--expert-slice-gb slices hsx's expansion of the experts; vllm holds"):
        ExtractOptions(out=tmp_path / "v", expert_slice_gb=1.0, **common).refuse_unused("vllm", generated=False)


# ---------------------------------------------------------------- TP / EP


@pytest.mark.parametrize(("name", "expert"), [("packed", 1), ("kimi-int4", 2)])
def test_tp2_and_tp2_ep2_of_the_packed_model_equal_one_process_but_for_near_ties(models, tmp_path, name, expert):
    """TP2 of the Kimi-K2-Thinking form, TP2 + EP2 of the Kimi-K2.5 composite (hsx's own expert
    split: each EP rank holds its own experts packed) against the dequantized model in one process."""
    from test_parallel import NEAR_TIE_SHARE, TOL, off_tokens

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(12, start=200))
    out = tmp_path / "run"
    proc = hsx(
        "extract", "--model", models[name], "--data", data, "--out", out, "--layers", "0,1", "--dtype", "float32",
        "--shard-size", "6", "--batch-tokens", "512", "--device", "cpu", "--tensor-parallel", "2",
        "--expert-parallel", str(expert),
    )  # fmt: skip
    assert "ranks 0-1 captured the same states on the first batch" in proc.stdout + proc.stderr
    spec = json.loads((out / "hsx.json").read_text())
    assert spec["parallel"] == {"tensor": 2, "expert": expert, "pipeline": 1}
    assert spec["model"]["quantization"]["experts"] == "int4-packed group 32"
    if expert > 1:
        assert f"routed experts held as int4-packed, expanded per layer to float32, each of {expert} ranks" in (
            proc.stdout + proc.stderr
        )
    off, total, worst = off_tokens(out, models[REFERENCE[name]])
    print(f"{name} TP2 EP{expert}: {off} of {total} tokens beyond {TOL} (near-ties); the others within {worst:.2e}")
    assert total > 500
    assert off <= NEAR_TIE_SHARE * total
    assert worst <= TOL


# ---------------------------------------------------------------- kill -9 of a packed run


@pytest.mark.faults
def test_kill9_of_a_packed_run_at_progress_points_then_resume_is_byte_identical(models, tmp_path):
    """Two kills, each after k new sample files (k seeded, the seed printed), then a resume:
    the files equal an uninterrupted run's byte for byte, and none is rewritten once verified."""
    from conftest import kill_after_new_files

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(24, start=300))

    def args(out: Path) -> list:
        return [
            "extract", "--model", models["packed"], "--data", data, "--out", out, "--layers", "0,1",
            "--shard-size", "6", "--batch-tokens", "256", "--writers", "2", "--device", "cpu",
        ]  # fmt: skip

    hsx(*args(tmp_path / "reference"))
    reference = run_files(tmp_path / "reference")
    assert len(reference) == 24
    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    print(f"HSX_CRASH_SEED={seed}")
    rng = random.Random(seed)
    out = tmp_path / "crashed"
    verified: dict = {}
    for i in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsx", *map(str, args(out))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        kill_after_new_files(proc, out, rng.randint(1, 6), seed)
        assert proc.returncode == -signal.SIGKILL, f"seed {seed}: kill {i} did not land mid-run"
        assert len(run_files(out)) < 24, f"seed {seed}: kill {i} came after the run had finished"
        now = verified_files(out)
        assert all(now.get(p) == ident for p, ident in verified.items()), f"seed {seed}: a verified file changed"
        verified = now
    hsx(*args(out))
    assert run_files(out) == reference, f"seed {seed}"
    final = verified_files(out)
    assert all(final[p] == ident for p, ident in verified.items()), f"seed {seed}: rewritten by the resume"


def test_a_loaded_model_packed_in_memory_computes_as_its_dequantized_experts():
    """``from_dense`` (what ``hsx bench --int4-experts`` does): the model with its experts packed
    computes what the same model computes with those experts dequantized into its parameters."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config()).eval()
    fmt = int4.Int4Experts(32)
    ids = torch.as_tensor(SEQS[0])[None].long()
    dense = jit.stored_bytes(model)
    jit.from_dense(model, fmt, lambda w: int4.quantize(w, 32))
    assert jit.stored_bytes(model) < 0.2 * dense and len(dict(jit.stored_modules(model))) == 2
    with torch.no_grad():
        packed = model(ids, output_hidden_states=True).hidden_states
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config()).eval()
    for name, module in jit.stored_modules(model):
        target = reference.get_submodule(name)
        for fused in jit.PROJECTIONS:
            getattr(target, fused).data = fmt.expand(module.stored(fused), torch.float32)
    with torch.no_grad():
        want = reference(ids, output_hidden_states=True).hidden_states
    assert all(torch.equal(a, b) for a, b in zip(packed, want, strict=True))


def test_packed_experts_trace_into_the_decoder_layers_graph():
    """Under torch.compile a MoE decoder layer with packed experts is one graph, as the same layer
    with dense experts is: expansion, routing and weighting traced together (dynamo's own count of
    graph breaks, on the same inputs), and the traced layer computes what it computes eagerly."""
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config()).eval()
    ids = torch.as_tensor(SEQS[0])[None].long()
    captured = {}
    layer = model.model.layers[1]
    hook = layer.register_forward_pre_hook(lambda m, a, k: captured.update(args=a, kwargs=k), with_kwargs=True)
    with torch.no_grad():
        model(ids)
    hook.remove()

    def breaks() -> int:
        torch._dynamo.reset()
        with torch.no_grad():
            return torch._dynamo.explain(layer)(*captured["args"], **captured["kwargs"]).graph_break_count

    dense = breaks()
    jit.from_dense(model, int4.Int4Experts(32), lambda w: int4.quantize(w, 32))
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.experts, jit.StoredExperts)
    assert breaks() == dense == 0
    with torch.no_grad():
        eager = layer(*captured["args"], **captured["kwargs"])
        torch._dynamo.reset()
        traced = torch.compile(layer, backend="eager", fullgraph=True)(*captured["args"], **captured["kwargs"])
    assert torch.equal(
        eager[0] if isinstance(eager, tuple) else eager, traced[0] if isinstance(traced, tuple) else traced
    )


def test_a_traced_layer_runs_its_sliced_experts_outside_its_graph():
    """Under torch.compile a MoE decoder layer whose experts are sliced breaks its graph only at
    ``sliced`` (which pairs a slice gets is known only once routed) and computes what it computes
    eagerly."""
    import torch._dynamo

    model = sliced_model(int4.Int4Experts(32), "grouped_mm", torch.bfloat16)
    captured = {}
    layer = model.model.layers[1]
    hook = layer.register_forward_pre_hook(lambda m, a, k: captured.update(args=a, kwargs=k), with_kwargs=True)
    with torch.no_grad():
        model(torch.as_tensor(SEQS[2])[None].long())
    hook.remove()
    layer.mlp.experts.slice_bytes = 3 * jit.expert_bytes(layer.mlp.experts, torch.bfloat16)
    with torch.no_grad():
        eager = layer(*captured["args"], **captured["kwargs"])
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(*captured["args"], **captured["kwargs"])
        torch._dynamo.reset()
        traced = torch.compile(layer, backend="eager")(*captured["args"], **captured["kwargs"])
    assert explained.graph_break_count >= 1
    assert all("sliced" in r.reason for r in explained.break_reasons), [r.reason for r in explained.break_reasons]
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    assert torch.equal(first(eager), first(traced))
