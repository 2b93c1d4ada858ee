"""The dequantizing grouped GEMM of INT4-packed experts (hsx.capture.quantized.int4_kernel), run on
CPU in Triton's interpreter, in float16: the interpreter rounds float32 to bfloat16 by truncation
and multiplies bfloat16 operands as integers (Triton 3.9), while its float16 goes through numpy's
own conversions and products. The kernel's code is the same for both dtypes; bfloat16 runs on CUDA
(tests/test_cuda.py).

The reference is independent of the kernel: the weights expanded by ``int4.Int4Experts.expand`` (held
to compressed-tensors' own dequantization in test_quantized), each expert's rows multiplied in
float64 and rounded once. A GEMM that adds in float32 lands on that rounding or on the value next to
it, never further.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import require
from hsx.capture.quantized import experts as jit
from hsx.capture.quantized import int4

require("compressed_tensors")


@pytest.fixture(scope="module")
def kernel():
    """int4_kernel in Triton's interpreter (conftest chooses it where there is no CUDA)."""
    require("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from hsx.capture.quantized import int4_kernel

    if not isinstance(int4_kernel._grouped, InterpretedFunction):
        pytest.skip("the kernel is compiled for CUDA here: tests/test_cuda.py runs it")
    return int4_kernel


def packed_experts(experts: int, n: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return int4.quantize(torch.randn(experts, n, k, dtype=torch.bfloat16) * 0.05, 32)


def exact_product(x: torch.Tensor, expanded: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's rows of ``x`` times its ``expanded`` weight transposed, in float64, and the same
    product of their absolute values (what bounds a float32 sum's error)."""
    ends = torch.tensor(counts).cumsum(0).tolist()
    rows = [(x[end - c : end].double(), w.double()) for w, c, end in zip(expanded, counts, ends, strict=True)]
    return torch.cat([a @ w.T for a, w in rows]), torch.cat([a.abs() @ w.abs().T for a, w in rows])


def beyond_one_rounding(out: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, k: int) -> int:
    """How many of ``out``'s values are further from ``exact`` than the value next to its rounding
    to ``out``'s dtype, give or take what a float32 sum of ``k`` products may lose (k * 2^-24 of
    the sum of their magnitudes: a sum that cancels to a small value keeps an error of the terms')."""
    rounded = exact.to(out.dtype)
    inf = torch.tensor(float("inf"), dtype=out.dtype, device=out.device)
    step = (rounded.abs().nextafter(inf) - rounded.abs()).double()
    slack = step + k * 2.0**-24 * magnitude
    return int(((out[: len(exact)].double() - rounded.double()).abs() > slack).sum())


@pytest.mark.parametrize("k", [256, 224], ids=["4-steps-of-64", "7-steps-of-32"])
def test_the_kernel_is_the_expanded_weights_product_rounded_once(kernel, k):
    """Experts with no rows, one row, rows spanning two tiles, an output width that is not a whole
    number of tiles, K in four steps of 64 or seven of 32: each value is the expanded weights' exact
    product rounded once (or the value next to it: float32 sums in another order), nearly all of
    them exactly. A scale read from the wrong group is caught."""
    counts = [3, 0, kernel.BLOCK_M + 6, 1, 40]
    stored = packed_experts(len(counts), 200, k)  # bf16 scales, as Kimi-K2.5 stores them
    x = torch.randn(sum(counts), k, dtype=torch.float16)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = kernel.grouped_linear(x, kernel.Packed.of(stored, 32), offsets)
    exact, magnitude = exact_product(x, int4.Int4Experts(32).expand(stored, torch.float16), counts)
    assert out.shape == (sum(counts), 200) and out.dtype == torch.float16
    assert beyond_one_rounding(out, exact, magnitude, x.shape[1]) == 0
    same = int((out == exact.to(out.dtype)).sum())
    assert same >= 0.99 * out.numel(), f"{same} of {out.numel()} values are the exact product rounded"
    misread = dict(stored, weight_scale=stored["weight_scale"].roll(1, dims=-1))
    misread_out = kernel.grouped_linear(x, kernel.Packed.of(misread, 32), offsets)
    assert beyond_one_rounding(misread_out, exact, magnitude, x.shape[1]) > 0.5 * out.numel()


def test_the_schedule_gives_each_expert_whole_tiles_and_no_more(kernel):
    """Each tile lies within one expert's rows; every row is in exactly one tile; the tiles past the
    last say so (-1)."""
    counts = [0, 1, kernel.BLOCK_M, kernel.BLOCK_M + 1, 0, 5]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    experts, first = kernel.schedule(offsets, sum(counts))
    covered = []
    for e, row in zip(experts.tolist(), first.tolist(), strict=True):
        if e < 0:
            continue
        start, end = int(offsets[e]) - counts[e], int(offsets[e])
        assert start <= row < end
        covered += range(row, min(row + kernel.BLOCK_M, end))
    assert covered == list(range(sum(counts)))
    assert (experts[experts >= 0].diff() >= 0).all() and (experts[-1] == -1)


def moe_states(device: str, dtype: torch.dtype, calls: list) -> tuple[torch.Tensor, torch.Tensor]:
    """test_quantized's tiny DeepSeek-V3 (16 experts, top 4) with INT4-packed experts: its states
    [layer, token, hidden] with the experts expanded for transformers' grouped_mm, then on the kernel
    (``calls`` gets each launch's grid), nothing expanded."""
    from hsx.capture.quantized import int4_kernel
    from test_quantized import VOCAB, sliced_model

    model = sliced_model(int4.Int4Experts(32), "grouped_mm", dtype).to(device)
    ids = torch.randint(0, VOCAB, (1, 96), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expanded = torch.stack(model(ids, output_hidden_states=True).hidden_states)[1:, 0].float()
    for _, module in jit.stored_modules(model):
        module.dequantizing = True
    kernel = int4_kernel._grouped
    int4_kernel._grouped = _counted(kernel, calls)
    expand, jit.StoredExperts.expand = jit.StoredExperts.expand, lambda self: pytest.fail("experts expanded")
    try:
        with torch.no_grad():
            fused = torch.stack(model(ids, output_hidden_states=True).hidden_states)[1:, 0].float()
    finally:
        int4_kernel._grouped, jit.StoredExperts.expand = kernel, expand
    return expanded, fused


def beyond_tolerance(expanded: torch.Tensor, fused: torch.Tensor, tight: float, flip: float, share: float) -> None:
    """A token whose routing a near-tie flips differs by O(1) from there on: those (beyond ``flip``
    at some layer) are counted and at most ``share`` of the tokens, and every other token matches
    within ``tight``."""
    assert tight < flip
    error = ((fused - expanded).norm(dim=-1) / expanded.norm(dim=-1)).amax(0)  # a token's worst layer
    flipped = int((error > flip).sum())
    assert flipped <= share * len(error), f"{flipped} of {len(error)} tokens beyond {flip}"
    assert error[error <= flip].max() < tight, error.sort().values[-8:]


def test_a_moe_model_on_the_kernel_computes_its_expanded_experts_states(kernel):
    """In float16, on the kernel against the same model expanding its experts for transformers'
    grouped_mm: nothing is expanded, the kernel runs for each MoE layer's two projections, and the
    states agree but for another GEMM's float32 sums."""
    calls = []
    expanded, fused = moe_states("cpu", torch.float16, calls)
    assert len(calls) == 2 * 2  # two MoE layers, their up and down projections
    beyond_tolerance(expanded, fused, tight=2e-3, flip=1e-2, share=0.05)


def _counted(fn, calls: list):
    class Counted:
        def __getitem__(self, grid):
            calls.append(grid)
            return fn[grid]

    return Counted()


def test_the_node_bench_runs_a_stage_on_the_kernel(kernel, tmp_path, capsys, monkeypatch):
    """``hsx.bench.node --experts int4-gemm`` builds a stage whose packed experts run on the kernel
    (nothing expanded; here in the interpreter, which only times it), and is refused by name where
    the kernel cannot run."""
    import json

    from hsx.bench import node
    from test_quantized import tiny_config

    config = tiny_config(n_routed_experts=16, num_experts_per_tok=4, num_hidden_layers=3).to_dict()
    config |= {"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": int4.quantization_config(32)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    calls = []
    monkeypatch.setattr(kernel, "_grouped", _counted(kernel._grouped, calls))
    monkeypatch.setattr(jit.StoredExperts, "expand", lambda self: pytest.fail("experts expanded"))
    args = [
        "--model", str(tmp_path), "--device", "cpu", "--ranks", "1", "--experts", "int4-gemm", "--samples", "8",
        "--mean-len", "24", "--min-len", "8", "--max-len", "48", "--batch-tokens", "96", "--warm-up", "1",
    ]  # fmt: skip
    node.main(args)
    assert "rank model: 3 of 3 layers, experts int4-gemm" in capsys.readouterr().out
    assert calls
    with pytest.raises(SystemExit):
        node.main([*args, "--expert-slice-gb", "1"])
    assert "--experts int4-gemm expands none" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SystemExit):
        node.main(args)
    assert "--experts int4-gemm runs a Triton kernel: on CUDA" in capsys.readouterr().err


def test_an_extraction_on_the_kernel_records_it_and_computes_the_expanded_runs_states(kernel, tmp_path, caplog):
    """``hsx extract --quantized-compute int4`` of the Kimi-K2-Thinking form (float16 on CPU, the
    kernel in Triton's interpreter): the spec records it, the log says the experts are read packed,
    none is expanded, and the states are those of the same run expanding them, but for another
    GEMM's float32 sums (near-tie flips counted and bounded). A resume asking the other compute is
    refused by name; one with the run's own settings writes a deleted shard's bytes again. Where
    the kernel cannot run (no interpreter on CPU, float32, vLLM, a slice budget) it is refused by
    name before anything is written."""
    import json
    import logging
    import shutil

    from conftest import conversations, load_states, run_files, save_random, unwrite, write_jsonl
    from hsx.errors import OptionError, Refused
    from hsx.extract import ExtractOptions, extract
    from test_quantized import LAYERS, kimi_thinking, tiny_config

    save_random(tiny_config(), tmp_path / "dense")
    kimi_thinking(tmp_path / "dense", tmp_path / "packed", tmp_path / "reference")
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(12, start=400))
    common = dict(model=str(tmp_path / "packed"), data=[data], device="cpu", layers=LAYERS, shard_size=6)
    common |= dict(dtype="float16", writers=1, batch_tokens=2048)
    expanded = tmp_path / "expanded"
    assert extract(ExtractOptions(out=expanded, **common), log=lambda m: None).complete
    out = tmp_path / "int4"
    logged = []
    with caplog.at_level(logging.WARNING, logger="hsx.checkpoint"):
        assert extract(ExtractOptions(out=out, quantized_compute="int4", **common), log=logged.append).complete
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "int4-packed, read packed by a grouped GEMM that dequantizes them to float16" in said, said
    assert "  routed experts expanded: none (read packed by the dequantizing GEMM): 0.0 GB" in logged, logged
    assert json.loads((out / "hsx.json").read_text())["quantized_compute"] == "int4"
    assert json.loads((expanded / "hsx.json").read_text())["quantized_compute"] is None
    files = run_files(out)
    assert files.keys() == run_files(expanded).keys() and len(files) == 12
    ours = [load_states(out / "shards" / name) for name in files]
    theirs = [load_states(expanded / "shards" / name) for name in files]

    def taps(files: list[dict]) -> torch.Tensor:  # [layer, token, hidden]: the aux states [T, L*H], then the final
        per_layer = [torch.cat([f["aux_hidden_states"], f["hidden_states"]], dim=-1).float() for f in files]
        return torch.cat(per_layer).unflatten(-1, (len(LAYERS) + 1, -1)).transpose(0, 1)

    beyond_tolerance(taps(theirs), taps(ours), tight=2e-3, flip=1e-2, share=0.05)

    with pytest.raises(Refused, match="quantized compute: run has int4, asked for dequantized"):
        extract(ExtractOptions(out=out, quantized_compute="dequantized", **common), log=lambda m: None)
    unwrite(out, 1)
    assert extract(ExtractOptions(out=out, **common), log=lambda m: None).complete
    assert run_files(out) == files

    refusals = [
        (dict(dtype="float32"), "the dequantizing GEMM multiplies bfloat16 or float16, and the run's dtype is float32"),
        (dict(expert_slice_gb=1.0), "--quantized-compute int4 expands none"),
    ]
    for over, reason in refusals:
        with pytest.raises(OptionError, match=reason):
            extract(ExtractOptions(out=tmp_path / "refused", quantized_compute="int4", **(common | over)), log=print)
        assert not (tmp_path / "refused" / "hsx.json").exists()
        shutil.rmtree(tmp_path / "refused", ignore_errors=True)
    with pytest.raises(OptionError, match="--quantized-compute int4 runs hsx's own experts kernel; vllm runs its own"):
        ExtractOptions(out=tmp_path / "v", quantized_compute="int4", **common).refuse_unused("vllm", generated=False)
    os.environ.pop("TRITON_INTERPRET")
    try:
        with pytest.raises(OptionError, match="a Triton kernel for CUDA, and the device is cpu"):
            extract(ExtractOptions(out=tmp_path / "refused", quantized_compute="int4", **common), log=print)
    finally:
        os.environ["TRITON_INTERPRET"] = "1"


def test_each_ep_rank_on_the_kernel_gives_its_partial_sum(kernel):
    """EP2 (a group of one process here, whose all-reduce adds nothing): each rank's share of the
    experts on the kernel gives the rank's partial output of the layer as the same rank expanding
    them for grouped_mm does, routes to the other rank's experts adding nothing; the two partials
    add up to the whole layer's output on the kernel. Within float32 sums in another order."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from test_quantized import HIDDEN, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(n_routed_experts=16, num_experts_per_tok=4))
    model = model.to(torch.float16).eval()
    model.set_experts_implementation("grouped_mm")
    dense = model.model.layers[1].mlp.experts
    hidden = torch.randn(97, HIDDEN, dtype=torch.float16)
    routed = torch.stack([torch.randperm(16)[:4] for _ in range(97)])
    weights = torch.rand(97, 4, dtype=torch.float16)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    outputs = {}
    try:
        for size in (1, 2):
            for rank in range(size):
                cls = jit.stored_class(type(dense), int4.Int4Experts(32), torch.float16, ep_rank=rank, ep_size=size)
                experts = cls(dense.config)
                mine = slice(rank * 16 // size, (rank + 1) * 16 // size)
                for fused in jit.PROJECTIONS:
                    experts.set_stored(fused, int4.quantize(getattr(dense, fused).detach()[mine], 32))
                with torch.no_grad():
                    expanded = experts(hidden, routed, weights)
                    experts.dequantizing = True
                    outputs[size, rank] = experts(hidden, routed, weights)
                torch.testing.assert_close(outputs[size, rank], expanded, rtol=4e-3, atol=2e-4)
    finally:
        dist.destroy_process_group()
    assert all(out.abs().sum() > 0 for out in outputs.values())
    both = outputs[2, 0].float() + outputs[2, 1].float()
    torch.testing.assert_close(both, outputs[1, 0].float(), rtol=4e-3, atol=2e-4)
    assert not torch.allclose(outputs[2, 0], outputs[1, 0], rtol=4e-3, atol=2e-4)  # a partial is not the whole


def test_the_released_shapes_run_on_the_kernel_and_an_odd_one_is_refused(kernel):
    """Kimi-K2.5's language model as its config.json is released (a composite: the sizes under
    text_config) and Moonlight's take the kernel's steps; an expert size that is not a multiple of
    32 is refused by name, as is a dtype the GEMM does not multiply."""
    from hsx.target import LanguageModel

    bench = Path(__file__).parent.parent / "bench"
    kimi = LanguageModel.of(bench / "kimi-k25-shape").config
    assert (kimi["hidden_size"], kimi["moe_intermediate_size"]) == (7168, 2048)
    moonlight = LanguageModel.of(bench / "moonlight-16b-a3b-shape").config
    for config in (kimi, moonlight):
        assert int4.gemm_blocker("cpu", "bfloat16", config) is None  # the interpreter here; CUDA elsewhere
    odd = int4.gemm_blocker("cpu", "bfloat16", kimi | {"moe_intermediate_size": 2000})
    assert odd == (
        "the dequantizing GEMM takes inputs in steps of 32, and the experts' moe_intermediate_size 2000 is not"
    )
    assert "multiplies bfloat16 or float16, and the run's dtype is float32" in int4.gemm_blocker("cpu", "float32", kimi)


def test_kimi_k25_at_tp2_ep2_on_the_kernel_equals_one_process_but_for_near_ties(kernel, tmp_path):
    """The Kimi-K2.5 composite as released (vision tower beside the language model, the INT4
    quantization config inside text_config) extracted on the kernel by a TP2 + EP2 group, two
    processes each holding its own packed experts, against one process on the kernel: the spec
    records the compute and the layout; near-tie flips counted and bounded, every other token tight."""
    import json

    from conftest import conversations, hsx, load_states, run_files, write_jsonl
    from kimi_fixtures import kimi_k25_int4, language_model_reference

    model = kimi_k25_int4(language_model_reference(tmp_path / "lm"), tmp_path / "kimi", tmp_path / "dequantized")
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(8, start=200))
    # No shadow (--reference-every 0): in float16 this fixture's sample 1 has 2 of 58 tokens on router
    # near-ties against the plain path, over certify's allowance of 1, with or without the kernel
    # (left, in the stop's note); the comparison here is the two runs' own
    common = ("--model", model, "--data", data, "--layers", "0,1", "--dtype", "float16", "--shard-size", "4",
              "--batch-tokens", "512", "--device", "cpu", "--quantized-compute", "int4",
              "--reference-every", "0")  # fmt: skip
    hsx("extract", *common, "--out", tmp_path / "one")
    proc = hsx("extract", *common, "--out", tmp_path / "group", "--tensor-parallel", "2", "--expert-parallel", "2")
    said = proc.stdout + proc.stderr
    assert "read packed by a grouped GEMM that dequantizes them to float16 as it loads them, each of 2 ranks" in said
    spec = json.loads((tmp_path / "group" / "hsx.json").read_text())
    assert spec["quantized_compute"] == "int4" and spec["parallel"] == {"tensor": 2, "expert": 2, "pipeline": 1}
    files = run_files(tmp_path / "one")
    assert files.keys() == run_files(tmp_path / "group").keys() and len(files) == 8

    def taps(run) -> torch.Tensor:  # [layer, token, hidden]
        loaded = [load_states(run / "shards" / name) for name in files]
        rows = [torch.cat([f["aux_hidden_states"], f["hidden_states"]], dim=-1).float() for f in loaded]
        return torch.cat(rows).unflatten(-1, (3, -1)).transpose(0, 1)

    beyond_tolerance(taps(tmp_path / "one"), taps(tmp_path / "group"), tight=2e-3, flip=1e-2, share=0.05)
