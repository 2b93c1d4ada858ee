"""What each storage codec costs and saves on sample-shaped states, on the CPU, side by side.

For each codec and each kind of data it encodes whole sample files through ``format.encode`` (the
writer's own path, digest included) and reports stored / raw bytes, encode MB/s (of raw bytes) on
one thread and on N threads at once (the writer's pool), decode MB/s on one thread, and for fp8 the
error against its bound. Torch runs one intra-op thread meanwhile, so every figure is per core.

Data: random-normal states, and a heavy-tailed variant closer to a trained model's residual stream
(a scale mixture per element, per-channel scales, and a few outlier channels 50x the rest, like the
massive activations of trained LLMs). Random data is not a trained model's: quote ratios from it as
such, next to a ratio measured on real states.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hsx.store.codec import Codec, fp8_bound
from hsx.store.format import SampleTensors, decode, encode


@dataclass
class CodecResult:
    codec: str
    data: str
    ratio: float  # stored file bytes / raw file bytes
    encode_mbs: float  # one thread
    encode_mbs_n: float  # N threads together
    threads: int
    decode_mbs: float  # one thread
    max_err: float | None = None  # fp8: max |x̂ - x| / amax of its token-layer, all states
    rms_err: float | None = None  # fp8: mean over rows of RMS error / RMS of the row


def states(kind: str, tokens: int, hidden: int, layers: int, dtype: torch.dtype, seed: int = 0) -> SampleTensors:
    """A sample of ``kind`` normal | heavy with aux [tokens, layers*hidden] and final [tokens, hidden]."""
    g = torch.Generator().manual_seed(seed)

    def one(cols: int) -> torch.Tensor:
        x = torch.randn(tokens, cols, generator=g)
        if kind == "heavy":
            x *= torch.exp(0.5 * torch.randn(tokens, cols, generator=g))
            x *= torch.exp(0.5 * torch.randn(cols, generator=g))
            x[:, torch.randperm(cols, generator=g)[: max(1, cols // 1024)]] *= 50
        return x.to(dtype)

    return SampleTensors(
        sample_id=seed,
        input_ids=torch.randint(0, 128_000, (tokens,), generator=g),
        loss_mask=(torch.rand(tokens, generator=g) > 0.3).to(torch.uint8),
        aux=torch.cat([one(hidden) for _ in range(layers)], dim=1),
        final=one(hidden),
    )


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _fp8_error(sample: SampleTensors, layers: int, decoded: dict[str, torch.Tensor]) -> tuple[float, float]:
    worst, rms = 0.0, []
    for name, x, groups in (("aux_hidden_states", sample.aux, layers), ("hidden_states", sample.final, 1)):
        x = x.float().view(x.shape[0], groups, -1)
        err = (decoded[name].float().view(x.shape) - x).abs()
        amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        worst = max(worst, float((err / amax).max()))
        rms.append(err.pow(2).mean(-1).sqrt() / x.pow(2).mean(-1).sqrt().clamp_min(1e-30))
    return worst, float(torch.cat([r.flatten() for r in rms]).mean())


def _measure(
    sample: SampleTensors, layer_ids: list[int], codec: Codec, kind: str, raw_size: int, threads: int, repeats: int
) -> CodecResult:
    def write() -> None:
        encode(sample, layer_ids, codec)

    data = b"".join(encode(sample, layer_ids, codec)[0])
    one = _best(write, repeats)
    with ThreadPoolExecutor(threads) as pool:

        def write_all() -> None:
            list(pool.map(lambda _: write(), range(threads)))

        write_all()  # the threads started and warm
        many = _best(write_all, repeats)
    dec = _best(lambda: decode(data), repeats)
    r = CodecResult(
        codec=codec.value,
        data=kind,
        ratio=len(data) / raw_size,
        encode_mbs=raw_size / one / 1e6,
        encode_mbs_n=threads * raw_size / many / 1e6,
        threads=threads,
        decode_mbs=raw_size / dec / 1e6,
    )
    if codec is Codec.FP8:
        r.max_err, r.rms_err = _fp8_error(sample, len(layer_ids), decode(data))
    return r


def measure_states(
    sample: SampleTensors, layer_ids: list[int], threads: int, repeats: int = 3, kind: str = "model"
) -> list[CodecResult]:
    """Every codec on one given sample (a model's own states), torch on one intra-op thread."""
    intra = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        raw_size = sum(len(p) for p in encode(sample, layer_ids)[0])
        return [_measure(sample, layer_ids, codec, kind, raw_size, threads, repeats) for codec in Codec]
    finally:
        torch.set_num_threads(intra)


def bench_codecs(
    tokens: int = 2000,
    hidden: int = 4096,
    layers: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    threads: int | None = None,
    repeats: int = 3,
    kinds: tuple[str, ...] = ("normal", "heavy"),
) -> list[CodecResult]:
    """Measure every codec on each kind of data; ``threads`` defaults to min(8, CPUs)."""
    threads = threads or min(8, os.cpu_count() or 1)
    layer_ids = list(range(layers))
    results = []
    for kind in kinds:
        results += measure_states(states(kind, tokens, hidden, layers, dtype), layer_ids, threads, repeats, kind)
    return results


def print_codecs(results: list[CodecResult], dtype: torch.dtype = torch.bfloat16, echo=print) -> None:
    """The table, one line per (data, codec): ratios and MB/s side by side."""
    n = results[0].threads if results else 0
    echo(
        f"{'data':<7} {'codec':<5} {'stored/raw':>10} {'enc MB/s 1 thr':>14} {f'enc MB/s {n} thr':>15} "
        f"{'per thr':>8} {'dec MB/s':>9}  fp8 error (max/amax, rms)"
    )
    for r in results:
        err = "" if r.max_err is None else f"{r.max_err:.4f} (bound {fp8_bound(dtype):.4f}), {r.rms_err:.4f}"
        echo(
            f"{r.data:<7} {r.codec:<5} {r.ratio:>10.4f} {r.encode_mbs:>14.0f} {r.encode_mbs_n:>15.0f} "
            f"{r.encode_mbs_n / r.threads:>8.0f} {r.decode_mbs:>9.0f}  {err}"
        )


if __name__ == "__main__":
    print_codecs(bench_codecs())
