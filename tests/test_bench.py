"""The benchmark runs end to end (CPU, tiny model): every variant, compiled ones included, in one run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import HANG_GUARD_S, hsx


def test_bench_measures_every_variant_in_one_run(tmp_path):
    proc = hsx(
        "bench",
        "--device",
        "cpu",
        "--samples",
        "12",
        "--mean-len",
        "40",
        "--min-len",
        "8",
        "--max-len",
        "96",
        "--batch-tokens",
        "256",
        "--naive-samples",
        "3",
        "--workdir",
        tmp_path,
        "--compile",
        "on",
    )
    table = [line for line in proc.stdout.splitlines() if len(line[42:].split()) == 7]
    rows = {line[:42].strip(): line[42:].split() for line in table}  # tokens s tok/s GB/s x-fwd RSS dev
    for name in (
        "forward only (padded)",
        "naive (1/forward, all layers, torch.save)",
        "hsx extract (padded)",
        "forward only (packed)",
        "hsx extract (packed)",
        "forward only (packed, compiled)",
        "hsx extract (packed, compiled)",
        "hsx extract (packed, compiled, zstd)",
        "hsx extract (packed, compiled, fp8)",
        "hsx extract (packed, compiled, shadow)",
        "shadow (packed, compiled)",
        "disk alone (8 threads, fsync)",
    ):
        assert name in rows, proc.stdout
    assert rows["forward only (padded)"][4] == "1.00"  # the reference of the ratios
    tokens = {name: int(rows[name][0].replace(",", "")) for name in rows if name.startswith(("forward", "hsx"))}
    assert len(set(tokens.values())) == 1 and tokens["hsx extract (packed, compiled)"] > 0  # same work for each
    assert "hsx extract (padded) / naive:" in proc.stdout
    # the fidelity check's cost: timed on its own after each batch's capture, against the forward
    assert {"capture (packed, compiled)", "fidelity check (packed, compiled)"} <= rows.keys()
    assert rows["fidelity check (packed, compiled)"][0] == rows["forward only (packed, compiled)"][0]
    cost = next(line for line in proc.stdout.splitlines() if line.startswith("fidelity check (packed, compiled): "))
    assert "% of the forward pass" in cost
    # --teacher topk:64 beside it: the head on every masked token, the same batches, timed apart
    assert rows["teacher topk:64 (packed, compiled)"][0] == rows["forward only (packed, compiled)"][0]
    taught = next(line for line in proc.stdout.splitlines() if line.startswith("teacher topk:64 (packed, compiled): "))
    assert "% of the forward pass" in taught and "tokens given their top-64" in taught
    # the shadow's cost (hsx.certify): hsx with it at the default 1 in 1000 (ids 0-3 of these 12 samples),
    # and timed on its own against the forward, projected to a run
    shadow = next(line for line in proc.stdout.splitlines() if line.startswith("shadow (packed, compiled): "))
    assert "the forward pass's time per token" in shadow and "at 1 in 1000 samples: " in shadow, shadow
    waits = [line for line in proc.stdout.splitlines() if "the forward pass waited" in line]
    assert len(waits) == 6 and all(line.startswith("hsx extract (") for line in waits)
    # the codecs next to raw, on the same batches: stored / raw bytes, tok/s, encode MB/s (1 core, N threads)
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("codec  stored/raw"))
    codecs = {line.split()[0]: line.split()[1:] for line in lines[at + 1 : at + 4]}
    assert list(codecs) == ["raw", "zstd", "fp8"] and codecs["raw"][0] == "1.0000"
    assert 0.5 < float(codecs["zstd"][0]) < 1 and 0.25 < float(codecs["fp8"][0]) < 0.35  # fp8 of float32 states
    assert all(float(v[3].replace(",", "")) > 0 and float(v[4].replace(",", "")) > 0 for v in codecs.values())
    assert [v[-1] for v in codecs.values()] == ["-", "host", "host"]  # where encoded: on CPU all on the host
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself


def test_bench_consumer_extracts_again_beside_a_live_trainer_that_reads_every_batch(tmp_path):
    """--consumer: the last layout's extraction again with a trainer's stream in its own process,
    reading and acknowledging every batch (it must read them all, or the bench fails), and its
    tok/s against the same extraction without one; again with the trainer on one intra-op thread."""
    args = ("--samples", "12", "--mean-len", "40", "--min-len", "8", "--max-len", "96", "--batch-tokens", "256")
    proc = hsx(
        "bench", "--device", "cpu", *args, "--naive-samples", "0", "--workdir", tmp_path, "--compile", "off",
        "--codecs", "raw", "--consumer",
    )  # fmt: skip
    rows = {line[:42].strip(): line[42:].split() for line in proc.stdout.splitlines() if len(line[42:].split()) == 7}
    assert {"hsx extract (packed)", "hsx extract (packed, live consumer)"} <= rows.keys(), proc.stdout
    assert rows["hsx extract (packed, live consumer)"][0] == rows["hsx extract (packed)"][0]  # the same tokens
    for name in ("hsx extract (packed, live consumer)", "hsx extract (packed, live consumer, 1 thread)"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"{name} / without: "))
        assert float(line.split("without: ")[1].split("x")[0]) > 0
    assert list(tmp_path.iterdir()) == []


def test_pick_names_the_smallest_codec_that_keeps_pace_with_raw():
    """The bench's advice: zstd where it writes at >= 0.97x raw's rate, raw where it does not; fp8
    named beside it only where it keeps pace."""
    from hsx.bench.extract import Result, pick
    from hsx.store.codec import Codec

    def row(codec, seconds, ratio):
        return Result(f"hsx extract ({codec})", 1000, seconds, codec=codec, stored_ratio=ratio)

    fast = [row(Codec.RAW, 1.0, 1.0), row(Codec.ZSTD, 1.02, 0.69), row(Codec.FP8, 0.99, 0.5)]
    assert pick(fast).startswith("pick here: --codec zstd (lossless, 0.690x raw's bytes at 0.980x its tok/s)")
    assert "lossy: --codec fp8 keeps pace at 0.500x" in pick(fast)
    slow = [row(Codec.RAW, 1.0, 1.0), row(Codec.ZSTD, 1.2, 0.69), row(Codec.FP8, 1.1, 0.5)]
    assert pick(slow) == "pick here: --codec raw (lossless); under 0.97x raw's tok/s: zstd 0.833x, fp8 0.909x"


def test_node_bench_builds_one_ranks_shapes_and_counts_its_all_reduces():
    """hsx.bench.node: Kimi-K2.5 at TP8+EP8 is, per rank, 8 of 64 heads, 48 of 384 routed experts of
    which a token meets 1 of its 8, 1/8 of the dense MLP and of the vocabulary; the all-reduces
    of a forward are 1 + 2 per dense layer + 3 per MoE layer, each a ring over the bus bandwidth."""
    from hsx.bench.node import rank_config
    from hsx.capture.memory import Pace

    text = json.loads((Path(__file__).parent.parent / "bench" / "kimi-k25-shape" / "config.json").read_text())
    config = rank_config(text["text_config"], 8, 61)
    assert (config.num_attention_heads, config.n_routed_experts, config.num_experts_per_tok) == (8, 48, 1)
    assert (config.intermediate_size, config.vocab_size, config.shared_intermediate) == (2304, 20480, 256)
    assert (config.hidden_size, config.moe_intermediate_size, config.num_hidden_layers) == (7168, 2048, 61)
    count = 1 + 2 * 1 + 3 * 60
    assert Pace(0, 61, 1, True).allreduce_bytes(7168 * 2, 8) == count * 7168 * 2 * 2 * 7 / 8
    with pytest.raises(ValueError, match="num_attention_heads 64 does not split over 6 ranks"):
        rank_config(text["text_config"], 6, 61)


BENCH_REFUSED = [
    (("--fp8-model",), "the block-FP8 model cannot run here: torch has no block-scaled FP8 GEMM on cpu"),
    (("--fp8-model", "--int4-experts"), "--fp8-model and --int4-experts each rebuild the model: one of them per run"),
    (("--int4-experts",), "--int4-experts packs routed experts, and the default model on cpu has none"),
    (("--min-len", "100", "--max-len", "10"), "--min-len 100 is above --max-len 10"),
    (("--workdir", "NOPE"), "/NOPE: no such folder"),
    (("--model", "NOPE"), "/NOPE: no such model folder"),
    (("--max-new-tokens", "3"), "--max-new-tokens applies to the generate bench (--generate) only"),
    (
        ("--tensor-parallel-size", "2", "--max-new-tokens", "3"),
        "--max-new-tokens, --tensor-parallel-size apply to the generate bench (--generate) only",
    ),
    (("--generate", "--fp8-model", "--device", "cpu"), "--device, --fp8-model apply to the extraction bench"),
]


@pytest.mark.parametrize(("args", "said"), BENCH_REFUSED, ids=[" ".join(a) for a, _ in BENCH_REFUSED])
def test_every_bench_option_combination_it_cannot_run_is_refused_by_name(args, said, tmp_path):
    """``hsx bench`` without ``--device`` on a machine without CUDA (``--fp8-model`` ended in an
    AttributeError there), options one bench does not read given to the other, impossible lengths,
    missing folders: exit 2 with the reason, no traceback, nothing written."""
    import torch
    from typer.testing import CliRunner

    from hsx.cli import app

    if torch.cuda.is_available() and "--device" not in args:
        pytest.skip("without --device this machine's bench runs on CUDA")
    args = [str(tmp_path / a) if a == "NOPE" else a for a in args]
    r = CliRunner().invoke(app, ["bench", *args])
    assert r.exit_code == 2 and said in " ".join(r.output.split()), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert list(tmp_path.iterdir()) == []


def test_node_bench_times_the_stage_that_sets_a_pipelines_pace():
    """``--pipeline 8``: Kimi-K2.5's slowest stage under the partition an extraction makes is 8 MoE
    layers (the dense first layer is lighter); the most any stage hands on is the residual stream
    and the two aux states captured before the last stage (of [1, 29, 57]); one rank a stage does no
    all-reduce."""
    from hsx.bench.node import pace_stage, rank_config
    from hsx.capture.memory import Pace

    kimi = Path(__file__).parent.parent / "bench" / "kimi-k25-shape"
    text = json.loads((kimi / "config.json").read_text())["text_config"]
    pace = pace_stage(kimi, text, 1, 8)
    assert (pace.pace.layers, pace.pace.dense, pace.pace.embeddings, pace.handoff_states) == (8, 0, False, 3), pace
    config = rank_config(text, 1, 3, pace.pace.dense)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.first_k_dense_replace) == (384, 8, 0)
    assert pace.pace.allreduce_bytes(7168 * 2, 1) == 0.0
    assert Pace.handoff_bytes(7168 * 2, 3) == 3 * 7168 * 2


def test_node_bench_runs_a_stage_with_its_experts_expanded_a_slice_at_a_time(tmp_path, capsys, monkeypatch):
    """``hsx.bench.node --expert-slice-gb --gpu-memory`` at toy size on CPU: a pipeline stage of a
    tiny INT4 DeepSeek-V3 shape folder built and run with 3 of its 16 experts expanded at a time
    (never a whole layer), and the whole stage judged by ``hsx memory``'s arithmetic with the
    same slice."""
    from conftest import require
    from hsx.bench import node
    from hsx.capture.quantized import experts as jit
    from hsx.capture.quantized import int4
    from test_quantized import tiny_config

    require("compressed_tensors")
    config = tiny_config(n_routed_experts=16, num_experts_per_tok=4, num_hidden_layers=5).to_dict()
    config |= {"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": int4.quantization_config(32)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    one = 3 * 64 * 64 * 2  # an expert of the tiny shape in bf16
    sizes = []
    expand_slice = jit.StoredExperts.expand_slice
    monkeypatch.setattr(jit.StoredExperts, "expand", lambda self: pytest.fail("a whole layer was expanded"))
    monkeypatch.setattr(
        jit.StoredExperts, "expand_slice", lambda m, e: sizes.append(e.stop - e.start) or expand_slice(m, e)
    )
    budget = 3.5 * one / 1e9
    node.main([
        "--model", str(tmp_path), "--device", "cpu", "--ranks", "1", "--pipeline", "2", "--p2p-gbps", "25",
        "--expert-slice-gb", str(budget), "--gpu-memory", "1", "--samples", "6", "--mean-len", "24",
        "--min-len", "8", "--max-len", "48", "--batch-tokens", "96", "--warm-up", "1",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert f"routed experts expanded 3 of a MoE layer's 16 at a time (0.0 GB under --expert-slice-gb {budget:g}" in out
    assert sizes and max(sizes) == 3
    assert "memory, as hsx memory counts the whole stage:" in out
    assert (
        f"  3 of a MoE layer's 16 local experts expanded to bfloat16 at a time (--expert-slice-gb {budget:g}): " in out
    )
    assert "device: 1.0 GB, 0.9 GB usable (5% headroom): fits" in out
    assert "node (2 GPUs, PP2 x TP1+EP1: hand-offs" in out
    # the same stage with bf16 experts, the INT4 stage's reference (one layer built): nothing packed
    node.main([
        "--model", str(tmp_path), "--device", "cpu", "--ranks", "1", "--pipeline", "2", "--p2p-gbps", "25",
        "--experts", "bf16", "--layers", "1", "--samples", "6", "--mean-len", "24", "--min-len", "8",
        "--max-len", "48", "--batch-tokens", "96", "--warm-up", "1",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "rank model: 1 of 3 layers, experts bf16" in out and "node (2 GPUs, PP2 x TP1+EP1" in out


def test_the_fp8_kernel_bench_is_refused_by_name_without_a_hopper_gpu():
    """``python -m hsx.bench.fp8`` times the block-FP8 GEMM: on a machine without a CUDA device of
    compute capability 9.x it says so and exits, before importing any kernel."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("a Hopper GPU is here: the bench runs")
    proc = subprocess.run([sys.executable, "-m", "hsx.bench.fp8"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 1 and "needs a CUDA device of compute capability 9.x" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
