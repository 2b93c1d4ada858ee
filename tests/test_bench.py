"""The benchmark runs end to end (CPU, tiny model): every variant, compiled ones included, in one run."""

import json
from pathlib import Path

import pytest

from conftest import hsx


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
    waits = [line for line in proc.stdout.splitlines() if "the forward pass waited" in line]
    assert len(waits) == 5 and all(line.startswith("hsx extract (") for line in waits)
    # the codecs next to raw, on the same batches: stored / raw bytes, tok/s, encode MB/s (1 core, N threads)
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("codec  stored/raw"))
    codecs = {line.split()[0]: line.split()[1:] for line in lines[at + 1 : at + 4]}
    assert list(codecs) == ["raw", "zstd", "fp8"] and codecs["raw"][0] == "1.0000"
    assert 0.5 < float(codecs["zstd"][0]) < 1 and 0.25 < float(codecs["fp8"][0]) < 0.35  # fp8 of float32 states
    assert all(float(v[3].replace(",", "")) > 0 and float(v[4].replace(",", "")) > 0 for v in codecs.values())
    assert [v[-1] for v in codecs.values()] == ["-", "host", "host"]  # where encoded: on CPU all on the host
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself


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
    from hsx.bench.node import allreduce_seconds, rank_config

    text = json.loads((Path(__file__).parent.parent / "bench" / "kimi-k25-shape" / "config.json").read_text())
    config = rank_config(text["text_config"], 8, 61)
    assert (config.num_attention_heads, config.n_routed_experts, config.num_experts_per_tok) == (8, 48, 1)
    assert (config.intermediate_size, config.vocab_size, config.shared_intermediate) == (2304, 20480, 256)
    assert (config.hidden_size, config.moe_intermediate_size, config.num_hidden_layers) == (7168, 2048, 61)
    count = 1 + 2 * 1 + 3 * 60
    assert allreduce_seconds(1000, 7168, 61, 1, 8, 1e9) == count * 1000 * 7168 * 2 * 2 * 7 / 8 / 1e9
    with pytest.raises(ValueError, match="num_attention_heads 64 does not split over 6 ranks"):
        rank_config(text["text_config"], 6, 61)
