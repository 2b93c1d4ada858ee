"""Tensor- and expert-parallel extraction (hsx.extract.group), and pipelines of stages
(hsx.extract.stages), on CPU, two ranks over gloo.

The references are independent: transformers' own ``output_hidden_states`` of one-sample forwards
of the same checkpoint in one process. Dense models must match every token within 1e-5 (float32).
MoE models are discontinuous (a router near-tie picks other experts under another reduction
order, and that token differs by O(1) from there on), so their tests count the tokens beyond
1e-5 and bound their share; every other token must still match within 1e-5.

Their process faults (kills, full volumes, SIGTERM, Ray workers of TP groups) are in
test_parallel_faults, which builds the same models from this module's builders.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

from conftest import (
    TINY,
    conversations,
    hsx,
    load_states,
    run_files,
    save_tiny,
    write_jsonl,
)
from hsx.errors import Exit
from hsx.store import layout

TOL = 1e-5
NEAR_TIE_SHARE = 0.01  # at most this share of a MoE model's tokens may differ (router near-ties)
HIDDEN = 64
LAYERS = (0, 1)  # of 3-4 layers; the final state is captured too

DENSE = LlamaConfig(
    vocab_size=2048,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA whose kv heads split over 2 ranks
    head_dim=16,
)
QWEN3_MOE = Qwen3MoeConfig(
    vocab_size=2048,
    hidden_size=HIDDEN,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
)
DEEPSEEK_V3 = DeepseekV3Config(  # MLA (q/k head dim 24, v head dim 16), routed + shared experts
    vocab_size=2048,
    hidden_size=HIDDEN,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)


# The module fixtures below are test_parallel_faults' too: it imports them, and a module-scoped
# fixture is built once per module that uses it.
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The three tiny checkpoints."""
    root = tmp_path_factory.mktemp("parallel-models")
    configs = {"dense": DENSE, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}
    return {name: save_tiny(config, root / name) for name, config in configs.items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("parallel-data") / "convs.jsonl", conversations(60, start=200))


def _args(model: Path, data: Path, out: Path, *extra) -> list:
    return [
        "extract",
        "--model",
        model,
        "--data",
        data,
        "--out",
        out,
        "--layers",
        ",".join(map(str, LAYERS)),
        "--dtype",
        "float32",
        "--shard-size",
        "10",
        "--batch-tokens",
        "512",
        "--device",
        "cpu",
        *extra,
    ]


@pytest.fixture(scope="module")
def dense_tp(models, data, tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted TP=2 run of the dense model, and what it printed."""
    out = tmp_path_factory.mktemp("dense-tp") / "run"
    proc = hsx(*_args(models["dense"], data, out, "--tensor-parallel", "2"))
    return out, proc.stdout + proc.stderr


def off_tokens(out: Path, model_dir: Path) -> tuple[int, int, float]:
    """(tokens whose captured states differ from the reference by more than TOL at any captured
    layer, tokens in all, the largest difference of the other tokens)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    off = total = 0
    worst = 0.0
    for path in sorted((out / "shards").rglob("*.safetensors")):
        t = load_states(path)
        with torch.no_grad():
            ref = model(t["input_ids"][None].long(), output_hidden_states=True).hidden_states
        want = torch.cat([ref[k + 1][0] for k in LAYERS] + [ref[-1][0]], dim=-1)
        got = torch.cat([t["aux_hidden_states"], t["hidden_states"]], dim=-1)
        diff = (got - want).abs().amax(dim=-1)
        off += int((diff > TOL).sum())
        total += diff.numel()
        worst = max(worst, float(diff[diff <= TOL].max()))
    return off, total, worst


def test_tp2_dense_equals_the_single_process_reference_and_records_the_layout(dense_tp, models, data):
    out, printed = dense_tp
    assert "starting 2 ranks (tensor 2, expert 1) on cpu" in printed
    assert "ranks 0-1 captured the same states on the first batch" in printed  # the replication check ran
    files = run_files(out)
    assert len(files) == 60
    off, total, worst = off_tokens(out, models["dense"])
    assert off == 0, f"{off} of {total} tokens beyond {TOL} (a dense model has no near-ties)"
    assert worst <= TOL
    spec = json.loads((out / "hsx.json").read_text())
    assert spec["parallel"] == {"tensor": 2, "expert": 1, "pipeline": 1}
    assert not (out / layout.GROUP).exists()  # a group that ended cleanly leaves no record behind
    assert_figures(out, models["dense"], spec["fidelity"]["stride"])
    assert_certified(out, dense=True)


def test_tp2_stores_the_teacher_transformers_gives(models, tmp_path):
    """``--teacher topk:64`` on two tensor-parallel ranks, whose LM head is split over them: every
    masked position's top-64 is that of transformers' own log-softmax on one process."""
    from test_teacher import K, assert_topk_is_transformers_own

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(6))
    hsx(*_args(models["dense"], data, tmp_path / "run", "--tensor-parallel", "2", "--teacher", f"topk:{K}"))
    assert_topk_is_transformers_own(tmp_path / "run", models["dense"])


def assert_certified(out: Path, dense: bool) -> None:
    """The shadow recomputed samples 0-3 (the first few; 1 in 1000 by id) through transformers' plain
    path on the run's own ranks: every tap within its bound (a MoE model: but for the near ties
    allowed; a dense one, none), and the run's certificate says so."""
    from hsx import certify
    from hsx.store.format import read_header

    for sid in range(60):
        taps = certify.Taps.parse(read_header(layout.sample_path(out, sid, 10)).metadata["taps"])
        assert (taps.shadow is not None) == (sid < 4), sid
        assert taps.zero == taps.nonfinite == [0] * (len(LAYERS) + 1)
        if taps.shadow is not None:
            assert not taps.shadow.failed and taps.shadow.allowed == (0 if dense else 1), (sid, taps.shadow)
            assert max(taps.shadow.diff) < 1e-4  # float32: rounding alone
    cert = certify.read_certificate(out)
    assert cert.verdict == "passed" and cert.shadow.samples == [0, 1, 2, 3], cert


def assert_figures(out: Path, model_dir: Path, stride: int) -> None:
    """Every file's fidelity figure, measured by the group's sharded head, is the reference's: the
    tokens it checks, and the argmax of transformers' own logits there (but for near ties)."""
    from hsx import fidelity
    from hsx.store.format import read_header

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for path in sorted((out / "shards").rglob("*.safetensors")):
        sid, t, figure = layout.parse_sample_name(path.name), load_states(path), read_header(path).fidelity
        at = fidelity.positions(sid, t["loss_mask"].numpy(), stride)
        with torch.no_grad():
            predicted = model(t["input_ids"][None].long()).logits[0, at].argmax(-1)
        agreed = int((predicted == t["input_ids"][at + 1]).sum())
        assert figure.checked == len(at) and abs(figure.agreed - agreed) <= figure.near_ties, (sid, figure)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_tp2_ep2_moe_equals_the_reference_but_for_a_counted_share_of_near_ties(name, models, data, tmp_path):
    out = tmp_path / "run"
    proc = hsx(*_args(models[name], data, out, "--tensor-parallel", "2", "--expert-parallel", "2"))
    assert "ranks 0-1 captured the same states on the first batch" in proc.stdout + proc.stderr
    assert json.loads((out / "hsx.json").read_text())["parallel"] == {"tensor": 2, "expert": 2, "pipeline": 1}
    off, total, worst = off_tokens(out, models[name])
    print(f"{name}: {off} of {total} tokens beyond {TOL} (router near-ties); the others within {worst:.2e}")
    assert total > 2000
    assert off <= NEAR_TIE_SHARE * total
    assert worst <= TOL
    assert_certified(out, dense=False)


def test_a_layout_the_run_was_not_made_with_or_the_model_cannot_take_is_refused_by_name(
    dense_tp, models, data, tmp_path
):
    out, _ = dense_tp
    proc = hsx("extract", "--out", out, "--tensor-parallel", "1", check=False)
    assert proc.returncode == Exit.ACT
    assert "parallel: run has tensor 2, expert 1, asked for tensor 1, expert 1" in proc.stderr + proc.stdout
    refusals = [
        (TINY, ("--tensor-parallel", "2"), "num_key_value_heads = 1 does not split over 2 ranks"),
        (models["dense"], ("--tensor-parallel", "2", "--expert-parallel", "2"), "has no routed experts to split"),
        (models["qwen3_moe"], ("--tensor-parallel", "2", "--expert-parallel", "4"), "must be 1 or the tensor"),
    ]
    for i, (model, flags, reason) in enumerate(refusals):
        proc = hsx(*_args(model, data, tmp_path / f"new{i}", *flags), check=False)
        assert proc.returncode != 0 and reason in proc.stderr + proc.stdout, proc.stderr
        assert not (tmp_path / f"new{i}" / "hsx.json").exists()


# ---------------------------------------------------------------- kill -9 of a real group


def test_threads_given_reach_every_rank_and_a_rank_without_them_takes_its_share_of_the_cores(tmp_path, monkeypatch):
    """``--threads`` crosses from the options to the launched ranks (what ``group.Group`` hands the
    elastic launcher) and is what each rank's set-up gives torch; without it, the cores shared out."""
    from types import SimpleNamespace

    import torch.distributed.launcher.api as launcher

    from hsx.errors import Refused
    from hsx.extract import group
    from hsx.extract.options import ExtractOptions
    from hsx.extract.outcome import Failure, Outcome
    from hsx.spec import Parallel

    handed: list[tuple] = []

    def launch(config, entry):
        assert entry is group.rank_main and config.nproc_per_node == 2
        launched = Outcome(failure=Failure(error="Refused", message="launched"))
        return lambda *args: handed.append(args) or {0: launched.dump()}

    monkeypatch.setattr(launcher, "elastic_launch", launch)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    spec = SimpleNamespace(parallel=Parallel(tensor=2), model_dump_json=lambda: "{}")
    before = torch.get_num_threads()
    try:
        for threads, want in ((before + 1, before + 1), (None, 8 // 2)):
            opts = ExtractOptions(out=tmp_path / "run", device="cpu", threads=threads)
            with pytest.raises(Refused, match="launched"):
                group.Group().run(opts, spec, log=lambda m: None)
            on = group.RESOURCES.validate_json(handed[-1][5])  # rank_main's ``resources``
            assert on.threads == threads
            torch.set_num_threads(before)
            assert group.rank_device(on, 1, 2) == "cpu" and torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_fp8_expert_parallel_is_refused_where_transformers_ep_plan_fails():
    """FP8 routed experts are split by transformers' own EP plan, which fails under inference mode on
    the lowest transformers the pin admits: there the layout is refused by name before anything loads
    (CI runs this file on both ends of the pin), and on a newer one it is taken."""
    import transformers
    from packaging.version import Version

    from hsx.capture.transformers import FP8_EP_TRANSFORMERS, parallel_refusal

    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    refusal = parallel_refusal(config, 2, 2)
    if Version(transformers.__version__) < Version(FP8_EP_TRANSFORMERS):
        assert refusal is not None and f"fails on transformers {transformers.__version__}" in refusal, refusal
        assert "upgrade transformers, or run without --expert-parallel" in refusal
    else:
        assert refusal is None
    unquantized = {k: v for k, v in config.items() if k != "quantization_config"}
    assert parallel_refusal(unquantized, 2, 2) is None  # hsx splits unquantized experts itself, on every version
