"""Memory arithmetic before loading (hsx.capture.memory): Kimi-K2.5's shape folder on one 8 x H200
node (the released config.json, no weights), and tiny checkpoints whose header-based figures are
compared with what transformers really loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import conversations, write_jsonl
from hsx.capture import checkpoint, memory
from hsx.capture.memory import GB, Inventory, Layout
from hsx.errors import LayoutTooLarge
from hsx.extract import ExtractOptions, extract
from hsx.target import LanguageModel
from kimi_fixtures import kimi_k25, kimi_k25_int4, language_model_reference

KIMI = Path(__file__).parent.parent / "bench" / "kimi-k25-shape"
H200 = 141 * GB
LAYERS, EXPERTS, HIDDEN, MOE = 60, 384, 7168, 2048  # MoE layers of Kimi-K2.5 and their shapes


@pytest.fixture(scope="module")
def kimi() -> Inventory:
    return Inventory.of(KIMI)


def test_kimi_k25_tp8_ep8_fits_one_h200_node_with_its_experts_packed(kimi):
    est = memory.check(kimi, Layout(8, 8, "packed"), H200, 8)
    # the packed experts, from the released weight table: per expert, gate/up int32 [2048, 896] +
    # bf16 scales [2048, 224]; down int32 [7168, 256] + bf16 [7168, 64] (the int32 [2] shapes are not held)
    gate_up = 2048 * 896 * 4 + 2048 * 224 * 2
    down = 7168 * 256 * 4 + 7168 * 64 * 2
    packed = LAYERS * EXPERTS * (2 * gate_up + down)
    assert abs(packed / 2**30 - 3 * (157.50 + 19.69)) < 0.1  # the table's GiB per projection kind
    assert est.experts == round(packed / 8)
    # one layer's 48 local experts expanded to bf16, and the rest split and replicated
    assert est.expansion == 48 * 3 * MOE * HIDDEN * 2
    weights = est.experts + est.sharded + est.replicated
    assert 70 * GB < weights < 80 * GB, memory.gb(weights)
    assert est.total <= H200 * (1 - memory.HEADROOM)


def test_kimi_k25_non_expert_weights_are_transformers_own_model(kimi):
    """What is not a routed expert equals transformers' DeepseekV3ForCausalLM built (on the meta
    device) from the shape folder's text config: bf16, its router in float32; the TP8 split of
    it adds up to the whole."""
    from transformers import DeepseekV3ForCausalLM

    lm = LanguageModel.of(KIMI)
    config, _ = checkpoint._native_config(lm.config, lm)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    state = model.state_dict()
    rest = sum(t.numel() * t.element_size() for k, t in state.items() if ".mlp.experts." not in k)
    routed = sum(t.numel() for k, t in state.items() if ".mlp.experts." in k)
    assert routed == sum(m.numel for m in kimi.modules if m.expert) == LAYERS * EXPERTS * 3 * MOE * HIDDEN
    one = kimi.estimate(Layout(1, 1, "packed"))
    assert one.replicated == rest and one.sharded == 0
    eight = kimi.estimate(Layout(8, 8, "packed"))
    assert abs(eight.replicated + 8 * eight.sharded - rest) <= 8
    # the embeddings are replicated and lm_head split, as transformers' TP plan has them
    assert kimi.sharded(next(m for m in kimi.modules if m.name == "lm_head.weight"))
    assert not kimi.sharded(next(m for m in kimi.modules if m.name == "model.embed_tokens.weight"))


def test_kimi_k25_dequantized_is_refused_with_the_smallest_layout_that_fits(kimi):
    with pytest.raises(LayoutTooLarge) as refused:
        memory.check(kimi, Layout(8, 8, "dequantized"), H200, 8)
    said = str(refused.value)
    bf16 = LAYERS * EXPERTS * 3 * MOE * HIDDEN * 2  # ~2.03 TB of experts expanded to bf16
    assert f"1/8 of them: {memory.gb(bf16 / 8)}" in said, said
    assert "does NOT fit" in said
    assert "none on one node of 8 GPUs (TP32 + EP32, dequantized experts, bfloat16 would, on 32)" in said
    assert "with the experts kept packed, TP8 + EP8, packed experts, bfloat16 would fit" in said
    # EP1 (every expert on every rank) does not fit packed either; TP8 + EP8 is the smallest that does
    with pytest.raises(LayoutTooLarge, match=r"smallest layout that fits: TP8 \+ EP8, packed"):
        memory.check(kimi, Layout(8, 1, "packed"), H200, 8)


def test_kimi_k2_in_fp8_fits_one_h200_node_at_one_byte_per_expert_weight():
    """The same ~1T model in fine-grained FP8 (Kimi-K2-Instruct's and DeepSeek-V3's format): its
    routed experts stay FP8, one byte a weight plus a float32 scale per 128x128 block, 1/8 of them
    per GPU; TP8 + EP8 fits an H200 as nvidia-smi reports it (143,771 MiB), and expanded to bf16 it
    would need two nodes."""
    fp8 = Inventory.of(KIMI.parent / "kimi-k2-fp8-shape")
    h200 = 143_771 * 2**20
    per_layer = EXPERTS * 3 * MOE * HIDDEN  # FP8 weights of one MoE layer's experts: one byte each
    scales = EXPERTS * 3 * (MOE // 128) * (HIDDEN // 128) * 4
    est = memory.check(fp8, Layout(8, 8, "packed"), h200, 8)
    assert est.experts == round(LAYERS * (per_layer + scales) / 8)
    assert est.total <= h200 * (1 - memory.HEADROOM) < est.total + 5 * GB  # it fits, with little to spare
    with pytest.raises(LayoutTooLarge, match="does NOT fit"):
        memory.check(fp8, Layout(8, 8, "dequantized"), h200, 8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("memory")
    reference = language_model_reference(root / "reference")
    kimi_k25(reference, root / "kimi-bf16")
    kimi_k25_int4(reference, root / "kimi-int4", root / "int4-reference")
    for name in ("kimi-bf16", "kimi-int4"):  # the same checkpoints as shape folders: config.json only
        (root / f"{name}-shape").mkdir()
        shutil.copy(root / name / "config.json", root / f"{name}-shape" / "config.json")
    return {p.name: p for p in root.iterdir()}


def loaded_bytes(model_dir: Path, dtype: str) -> int:
    """The bytes hsx's loader really holds for the model: every tensor of its state dict, and the
    routed experts it holds as stored (their packed values and scales: non-persistent buffers)."""
    from hsx.capture.quantized import experts
    from hsx.capture.transformers import TransformersBackend

    model = TransformersBackend.load(model_dir, [0], dtype, "cpu").model
    held = sum(b.nbytes for _, m in experts.stored_modules(model) for b in m.buffers(recurse=False))
    return sum(t.nbytes for t in model.state_dict().values()) + held


@pytest.mark.parametrize(
    ("name", "dtype"), [("kimi-bf16", "bfloat16"), ("kimi-bf16", "float32"), ("kimi-int4", "bfloat16")]
)
def test_header_figures_are_the_loaded_models_bytes(tiny, name, dtype):
    """The language model's weights from the safetensors headers (the vision tower's left out), in
    the run's dtype, the INT4 experts packed as hsx holds them: exactly the bytes of the loaded
    model's tensors."""
    inventory = Inventory.of(tiny[name])
    assert inventory.source == "safetensors headers"
    form = memory.expert_form(tiny[name], "cpu", dtype)
    assert form == ("packed" if name == "kimi-int4" else "unquantized")
    est = inventory.estimate(Layout(1, 1, form, dtype))
    assert est.experts + est.replicated + est.sharded == loaded_bytes(tiny[name], dtype)


@pytest.mark.parametrize("name", ["kimi-bf16", "kimi-int4"])
def test_shapes_from_the_config_equal_the_headers(tiny, name):
    """A shape folder (config.json alone) is worked out from the DeepSeek-V3 shapes its config
    implies, and the quantization config for the packed bytes: the same figures as the headers of
    the real checkpoint, layout by layout."""
    shape, full = Inventory.of(tiny[f"{name}-shape"]), Inventory.of(tiny[name])
    assert shape.source == "config.json shapes"
    for layout in (Layout(1, 1, "packed"), Layout(2, 2, "packed"), Layout(2, 1, "dequantized", "float32")):
        assert shape.estimate(layout).__dict__ | {"source": ""} == full.estimate(layout).__dict__ | {"source": ""}


def test_extract_refuses_before_loading_a_layout_that_cannot_fit(tiny, tmp_path, monkeypatch):
    from hsx.capture.transformers import TransformersBackend

    loads = []
    monkeypatch.setattr(TransformersBackend, "load", classmethod(lambda cls, *a, **kw: loads.append(a)))
    monkeypatch.setattr(memory, "device_memory", lambda device, ranks: (200_000, 1, "a 200 kB device"))
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    opts = ExtractOptions(out=tmp_path / "run", model=str(tiny["kimi-int4"]), data=[data], device="cpu", writers=1)
    logged = []
    with pytest.raises(LayoutTooLarge, match=r"does not fit TP1, packed experts, float32 on 1 x 0.0 GB") as e:
        extract(opts, log=logged.append)
    assert "routed experts, packed (as stored), all of them (EP1)" in str(e.value)
    assert loads == []  # refused before any weight was loaded


def test_extract_logs_the_memory_of_its_layout_with_the_experts_packed(tiny, tmp_path):
    """An INT4 composite's run works out its memory with the experts as hsx holds them (packed),
    logs it before loading, and runs."""
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    opts = ExtractOptions(out=tmp_path / "run", model=str(tiny["kimi-int4"]), data=[data], device="cpu", writers=1)
    logged = []
    assert extract(opts, log=logged.append).complete
    assert "memory per GPU for TP1, packed experts, float32 (safetensors headers):" in logged, logged
    est = Inventory.of(tiny["kimi-int4"]).estimate(Layout(1, 1, "packed", "float32"))
    assert f"  routed experts, packed (as stored), all of them (EP1): {memory.gb(est.experts)}" in logged


def test_hsx_memory_prints_the_arithmetic_and_exits_2_where_it_cannot_fit():
    from conftest import hsx

    args = ["--model", KIMI, "--tensor-parallel", "8", "--expert-parallel", "8", "--gpus", "8", "--gpu-memory", "141"]
    # experts auto: the shape folder's INT4 routed experts are held as hsx loads them, packed
    fits = hsx("memory", *args)
    said = " ".join((fits.stdout + fits.stderr).split())
    assert "memory per GPU for TP8 + EP8, packed experts, bfloat16 (config.json shapes):" in said, said
    est = Inventory.of(KIMI).estimate(Layout(8, 8, "packed"))
    assert f"routed experts, packed (as stored), 1/8 of them: {memory.gb(est.experts)}" in said
    assert f"total: {memory.gb(est.total)}" in said and "(5% headroom): fits" in said
    refused = hsx("memory", *args, "--experts", "dequantized", check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    said = " ".join((refused.stdout + refused.stderr).split())  # as the console wrapped it
    assert "error: the model does not fit TP8 + EP8, dequantized experts, bfloat16 on 8 x 141.0 GB" in said
    bf16 = LAYERS * EXPERTS * 3 * MOE * HIDDEN * 2
    assert f"routed experts, dequantized (expanded to bfloat16), 1/8 of them: {memory.gb(bf16 / 8)}" in said
    assert "smallest layout that fits: none on one node of 8 GPUs" in said


# ---------------------------------------------------------------- which layout, from the node's links


def test_the_layout_advised_for_kimi_k25_is_tp_on_nvlink_and_a_pipeline_on_pcie(kimi):
    """8 GPUs: on PCIe at the published untuned all-reduce bandwidth (22.2 GB/s), TP8 + EP8's 183
    all-reduces a token cost 14,336 B x 1.75 each; 8 stages of one GPU all-reduce nothing, and
    fit 96 GB cards once their MoE layers' 384 experts are expanded a slice at a time (a whole
    layer at once does not fit): they are advised, with the slice. On NVLink (8 x H200) TP8 + EP8
    is advised, its all-reduces cheap there, though every layout fits."""
    from hsx.interconnect import Links

    pcie = memory.advise(kimi, Layout(experts="packed"), 8, 96 * GB, Links(22.2, 25.0, False, "stated"))
    tp8 = next(line for line in pcie if line.startswith("  TP8 + EP8"))
    assert "87.5 GB a GPU, fits; 183 all-reduces x 14,336 B x 1.75 / 22.2 GB/s = 206.8 us" in tp8
    assert "4,835 tok/s" in tp8  # 1 / 206.8 us: what the interconnect lets TP8 reach
    pp8 = next(line for line in pcie if line.startswith("  PP8 x TP1"))
    assert pp8.startswith(
        "  PP8 x TP1, packed experts, bfloat16: 122.1 GB a GPU, does NOT fit; with --expert-slice-gb 2.8"
    )
    assert "(31 of 384 experts expanded at a time): 91.0 GB, fits; hand-off 4 x 14,336 B / 25 GB/s" in pp8
    assert any(line.startswith("  PP4 x TP2 + EP2") and "does NOT fit; with --expert-slice-gb" in line for line in pcie)
    assert pcie[-1].startswith(
        "advice: --tensor-parallel 1 --expert-parallel 1 --pipeline-parallel 8 --expert-slice-gb 2.8 (PP8 x TP1, "
        "packed experts, bfloat16, experts expanded 2.8 GB at a time), since it moves the least a token"
    )
    nvlink = memory.advise(kimi, Layout(experts="packed"), 8, 150_700_000_000, Links(361.0, 380.0, True, "stated"))
    assert all("fits" in line and "NOT" not in line for line in nvlink[1:-1])
    assert nvlink[-1] == (
        "advice: --tensor-parallel 8 --expert-parallel 8 (TP8 + EP8, packed experts, bfloat16), since its "
        "all-reduces run on NVLink"
    )


def test_kimi_k25_pp8_fits_96_gb_with_its_experts_expanded_a_slice_at_a_time(kimi):
    """A stage of PP8 holds 8 layers' 384 packed experts (76.1 GB); one layer's expanded at once
    (33.8 GB) does not fit a 96 GB card, and the refusal names the slice that would; a slice of
    31 experts (2.8 GB, whole experts of 3 x 2048 x 7168 bf16) does, counted as a slice."""
    whole = kimi.estimate(Layout(1, 1, "packed", pipeline=8))
    one = 3 * MOE * HIDDEN * 2
    assert whole.expansion == EXPERTS * one and whole.expert_bytes == one
    with pytest.raises(LayoutTooLarge) as refused:
        memory.check(kimi, Layout(1, 1, "packed", pipeline=8), 96 * GB, 8)
    said = "with --expert-slice-gb 2.8 (31 of 384 experts expanded at a time, the same states) it would fit"
    assert f"{said} (91.0 GB per GPU)" in str(refused.value)
    est = memory.check(kimi, Layout(1, 1, "packed", pipeline=8, slice_gb=2.8), 96 * GB, 8)
    assert est.expansion == 31 * one and est.at_once == (31, 384)
    assert est.total == whole.total - whole.expansion + 31 * one
    assert "  31 of a MoE layer's 384 local experts expanded to bfloat16 at a time (--expert-slice-gb 2.8): 2.7 GB" in (
        est.lines(96 * GB)
    )
    assert est.fits(96 * GB) and not kimi.estimate(Layout(1, 1, "packed", pipeline=8, slice_gb=3.5)).fits(96 * GB)
    # a slice larger than the layer counts the layer
    assert kimi.estimate(Layout(8, 8, "packed", slice_gb=100.0)).expansion == 48 * one


def test_kimi_k25_pp8_with_its_experts_read_packed_counts_no_expansion(kimi):
    """--quantized-compute int4 (the dequantizing GEMM): a stage holds 8 layers' packed experts and
    expands none, so PP8 fits 96 GB without a slice; the layout and its line say so."""
    expanded = kimi.estimate(Layout(1, 1, "packed", pipeline=8))
    read = memory.check(kimi, Layout(1, 1, "packed", pipeline=8, expands=False), 96 * GB, 8)
    assert read.expansion == 0 and read.experts == expanded.experts
    assert read.total == expanded.total - expanded.expansion and read.slice_to_fit(96 * GB) is None
    assert "  routed experts expanded: none (read packed by the dequantizing GEMM): 0.0 GB" in read.lines(96 * GB)
    assert "PP8 x TP1, packed experts (read by the dequantizing GEMM), bfloat16" in read.lines()[0]


def test_hsx_memory_without_a_layout_advises_one_from_stated_bandwidths():
    from typer.testing import CliRunner

    from hsx.cli import app
    from hsx.errors import OptionError
    from hsx.extract.memory import MemoryOptions

    args = ["memory", "--model", str(KIMI), "--gpus", "8", "--gpu-memory", "96", "--allreduce-gbps", "22.2"]
    r = CliRunner().invoke(app, [*args, "--p2p-gbps", "25", "--interconnect", "pcie"])
    advice = next(line for line in r.output.splitlines() if line.startswith("advice:"))  # then the storage lines
    assert r.exit_code == 0 and "--pipeline-parallel 8 --expert-slice-gb 2.8" in advice, r.output
    r = CliRunner().invoke(app, args)  # no point-to-point figure, and no GPU here to measure
    assert r.exit_code == 0 and "give --gpu-memory, --allreduce-gbps and --p2p-gbps" in r.output, r.output
    # experts read packed by the dequantizing GEMM: PP8 fits unsliced, and the advice says how to ask for it
    r = CliRunner().invoke(app, [*args, "--p2p-gbps", "25", "--interconnect", "pcie", "--quantized-compute", "int4"])
    advice = next(line for line in r.output.splitlines() if line.startswith("advice:"))
    assert r.exit_code == 0 and "--pipeline-parallel 8 --quantized-compute int4 (PP8 x TP1" in advice, r.output
    with pytest.raises(OptionError, match="--quantized-compute int4 expands none"):
        MemoryOptions(model=str(KIMI), quantized_compute="int4", expert_slice_gb=2.8)


def test_a_run_given_no_layout_that_one_gpu_cannot_hold_is_refused_with_the_advice(tiny, tmp_path, monkeypatch):
    """On a node of 4 GPUs (simulated, as its measured links) a new run given no layout whose model
    one GPU cannot hold is refused before loading with which layout to run and why."""
    from hsx import interconnect
    from hsx.capture.transformers import TransformersBackend
    from hsx.interconnect import Links

    inventory = Inventory.of(tiny["kimi-int4"])
    tp1 = inventory.estimate(Layout(1, 1, "packed", "float32", 16384, 4096, 2))
    device = int(tp1.total * 0.9)  # one GPU does not hold it; 2 stages of TP2 + EP2 would
    loads = []
    monkeypatch.setattr(TransformersBackend, "load", classmethod(lambda cls, *a, **kw: loads.append(a)))
    monkeypatch.setattr(memory, "device_memory", lambda device_, ranks: (device, 4, "4 simulated GPUs"))
    monkeypatch.setattr(interconnect, "links", lambda gpus: Links(20.0, 25.0, False, "measured (simulated)"))
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    opts = ExtractOptions(out=tmp_path / "run", model=str(tiny["kimi-int4"]), data=[data], device="cpu", writers=1)
    with pytest.raises(LayoutTooLarge) as refused:
        extract(opts, log=lambda m: None)
    said = str(refused.value)
    assert "layouts of 4 GPUs" in said and "over PCIe (no NVLink): all-reduce 20 GB/s" in said, said
    assert "advice: --tensor-parallel 2 --expert-parallel 2 --pipeline-parallel 2 (PP2 x TP2 + EP2" in said
    assert said.endswith("(a new run, in another --out)")
    assert loads == []
