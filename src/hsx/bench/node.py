"""One node's extraction rate for a model larger than one GPU, timed on one GPU: one rank of a
tensor + expert parallel replica, or one stage of a pipeline, built at its shapes with random weights.

At TP = EP = N over a node of N GPUs, every rank runs the same tokens; the node's rate is one rank's
forward plus the collectives. A rank holds ``heads / N`` attention heads, ``1 / N`` of the dense and
shared-expert MLPs' intermediate size and of the vocabulary, and ``experts / N`` routed experts (INT4
packed as released, or block FP8), of which a token meets ``top_k / N`` on average: the rank is built
as that model (routing top ``top_k / N`` of its own experts). Each rank's forward is timed on packed,
compiled layers (as ``hsx extract`` runs on CUDA) over batches of the given sample length
distribution; the all-reduces it would do (after attention, the shared experts and the routed
experts of each layer) are added serially from a stated bus bandwidth, none overlapped. With
``--layers`` below the model's count, the first layers are built and the time is scaled by the
ratio of layer counts (the dense first layer counted as one of them).

With ``--pipeline P`` the node runs P stages of contiguous layers (``capture.stages``), each over
``--ranks`` GPUs (TP = EP within the stage): one rank of the stage that sets the pace (the most
compute, by the partition ``hsx extract --pipeline-parallel`` makes) is built and timed, its
all-reduces added as above (none at one rank a stage), and its hand-off to the next stage added at
a stated point-to-point bandwidth (the residual stream and the aux states captured so far, bf16),
none overlapped. With as many batches in flight as stages every stage runs at once, so the node
runs at that one stage's pace.

    python -m hsx.bench.node --model bench/kimi-k25-shape --ranks 8 --layers 16 --allreduce-gbps 361
    python -m hsx.bench.node --model bench/kimi-k25-shape --ranks 1 --pipeline 8 --layers 3 --p2p-gbps 25

``--expert-slice-gb GB`` expands each MoE layer's experts a slice at a time, as ``hsx extract
--expert-slice-gb`` does (the same states), and ``--gpu-memory GB`` judges the whole stage (or
rank) on a card of that size: ``hsx memory``'s arithmetic of it, against what the built layers
measured (their peak, and the peak above their weights next to the arithmetic's activations and
expansion), so that a stage built at fewer layers than the card holds still says whether the
whole stage fits:

    python -m hsx.bench.node --model bench/kimi-k25-shape --ranks 1 --pipeline 8 --layers 6 \
        --expert-slice-gb 2.8 --gpu-memory 96 --batch-tokens 16384 --p2p-gbps 25
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hsx.capture.memory import Pace

AUX_STATES = 4  # the story's sample files: three aux layers and the final state, bf16


@dataclass
class NodeEstimate:
    layers_built: int
    layers: int
    tokens: int
    seconds: float  # the rank's forward over ``tokens``, scaled to every layer (of its stage)
    allreduce_at_1: float  # the all-reduces over ``tokens`` at 1 GB/s of bus bandwidth, seconds
    mean_len: float
    hidden: int
    weight_bytes: int
    peak_bytes: int
    handoff_at_1: float = 0.0  # a pipeline stage's hand-offs of ``tokens`` at 1 GB/s, seconds
    memory: list[str] = field(default_factory=list)  # --gpu-memory: the whole stage's memory, counted and measured

    def collective_seconds(self, gbps: float | None) -> float:
        return self.allreduce_at_1 / gbps if self.allreduce_at_1 else 0.0

    def handoff_seconds(self, gbps: float | None) -> float:
        return self.handoff_at_1 / gbps if self.handoff_at_1 else 0.0

    def tok_s(self, allreduce_gbps: float | None = None, p2p_gbps: float | None = None) -> float:
        """The node's rate: the forward with the all-reduces and hand-offs added, none overlapped."""
        added = self.collective_seconds(allreduce_gbps) + self.handoff_seconds(p2p_gbps)
        return self.tokens / (self.seconds + added)

    def hours(self, samples: int, allreduce_gbps: float | None = None, p2p_gbps: float | None = None) -> float:
        return samples * self.mean_len / self.tok_s(allreduce_gbps, p2p_gbps) / 3600

    def storage_gb_per_hour(self, allreduce_gbps: float | None = None, p2p_gbps: float | None = None) -> float:
        return self.tok_s(allreduce_gbps, p2p_gbps) * AUX_STATES * self.hidden * 2 * 3600 / 1e9


def rank_config(text: dict, ranks: int, layers: int, dense: int | None = None):
    """The text model's config at one rank's shapes (see the module notes); ``dense``: how many of
    the ``layers`` built are dense (a pipeline stage past the model's dense first layers: none)."""
    from transformers import DeepseekV3Config

    cfg = {k: v for k, v in text.items() if k not in ("auto_map", "architectures", "quantization_config")}
    heads, routed, top_k = cfg["num_attention_heads"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    for key, whole in (("num_attention_heads", heads), ("n_routed_experts", routed), ("num_experts_per_tok", top_k)):
        if whole % ranks:
            raise ValueError(f"{key} {whole} does not split over {ranks} ranks")
    cfg.update(
        num_attention_heads=heads // ranks,
        num_key_value_heads=heads // ranks,
        intermediate_size=cfg["intermediate_size"] // ranks,
        vocab_size=cfg["vocab_size"] // ranks,
        n_routed_experts=routed // ranks,
        num_experts_per_tok=top_k // ranks,
        n_group=1,
        topk_group=1,
        num_hidden_layers=layers,
    )
    if dense is not None:
        cfg["first_k_dense_replace"] = dense
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "model_type"):
        cfg.pop(key, None)
    config = DeepseekV3Config(**cfg)
    config.shared_intermediate = cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 1) // ranks
    return config


def build_rank(config, experts: str, device: torch.device):
    """The rank's model, random weights, its routed experts INT4-packed (one layer quantized, copied to
    every layer: the same bytes and work), block FP8 (``to_block_fp8``) or bf16 parameters as
    transformers holds unquantized experts (the INT4 stage's reference: ``--layers`` small enough to
    hold them)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MLP

    from hsx.capture.quantized import experts as jit
    from hsx.capture.quantized import int4

    torch.manual_seed(0)
    dtype = torch.bfloat16
    if experts in ("int4", "int4-gemm"):
        fmt = int4.Int4Experts(32)
        with jit.swapped(DeepseekV3ForCausalLM, fmt, dtype), torch.device(device):
            model = DeepseekV3ForCausalLM._from_config(config, dtype=dtype)
        E, inter, hidden = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size

        def packed(rows: int, cols: int) -> dict[str, torch.Tensor]:
            """E random experts [rows, cols] INT4-packed, a few at a time (a stage's 384 at once in
            bf16 would take tens of GB before packing)."""
            parts = [
                int4.quantize(torch.randn(min(16, E - e), rows, cols, device=device, dtype=dtype) * 0.02)
                for e in range(0, E, 16)
            ]
            return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

        stored = {"gate_up_proj": packed(2 * inter, hidden), "down_proj": packed(hidden, inter)}
        for _, module in jit.stored_modules(model):
            module.compiled = device.type == "cuda"
            module.dequantizing = experts == "int4-gemm"  # the packed weights read by the GEMM itself
            for name, tensors in stored.items():
                module.set_stored(name, {k: tensors[k].clone() for k in fmt.stored})
    else:
        with torch.device(device):
            model = DeepseekV3ForCausalLM._from_config(config, dtype=dtype)
    for layer in model.model.layers:
        shared = getattr(layer.mlp, "shared_experts", None)
        if shared is not None:
            with torch.device(device):
                layer.mlp.shared_experts = DeepseekV3MLP(config, intermediate_size=config.shared_intermediate).to(dtype)
    if experts == "fp8":
        from hsx.bench.extract import to_block_fp8

        to_block_fp8(model)  # built bf16 first: a subset of layers (--layers) keeps that within one GPU
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return model.eval()


def batches(lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Samples sorted by length, packed greedily into rows of at most ``batch_tokens`` tokens."""
    out, cur, used = [], [], 0
    for n in sorted(lengths.tolist(), reverse=True):
        if cur and used + n > batch_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(int(n))
        used += n
    return out + ([cur] if cur else [])


@dataclass(frozen=True)
class PaceStage:
    """The stage of a pipeline that sets its pace (``capture.memory.Pace``), and the states a
    token carries to the next stage at the most."""

    pace: Pace
    handoff_states: int
    stages: str


def pace_stage(model: Path, text: dict, ranks: int, pipeline: int) -> PaceStage:
    """The stage with the most compute under the partition an extraction makes, and the largest
    hand-off of any stage (the default aux layers' states so far, and the residual stream)."""
    from hsx.capture import default_layers
    from hsx.capture.memory import Inventory, Layout

    inventory = Inventory.of(model)
    if inventory is None:
        raise ValueError(f"{model}: no weights, and no DeepSeek-V3 shapes in config.json to partition")
    layout = Layout(ranks, ranks, "packed", pipeline=pipeline)
    stages = inventory.stages(layout)
    aux = default_layers(int(text["num_hidden_layers"]))
    carried = max(1 + sum(k < e for k in aux) for _, e in stages.ranges[:-1])
    return PaceStage(inventory.pace(layout), carried, str(stages))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> NodeEstimate:
    from hsx.bench.extract import lognormal_lengths
    from hsx.capture import default_layers, varlen
    from hsx.capture.transformers import TransformersBackend

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    raw = json.loads((Path(args.model) / "config.json").read_text())
    text = raw.get("text_config", raw)
    layers = int(text["num_hidden_layers"])
    stage = None
    if args.pipeline > 1:
        stage = pace_stage(Path(args.model), text, args.ranks, args.pipeline)
        first, last = stage.pace.first, stage.pace.first + stage.pace.layers - 1
        print(f"pipeline of {args.pipeline} stages ({stage.stages}); the pace is stage layers "
              f"{first}-{last} ({stage.pace.dense} dense)", flush=True)  # fmt: skip
    pace = stage.pace if stage else Pace(0, layers, int(text.get("first_k_dense_replace", 0)), True)
    total, dense_total = pace.layers, pace.dense  # the layers one rank runs
    built = min(args.layers or total, total)
    config = rank_config(text, args.ranks, built, min(dense_total, built) if stage else None)
    t0 = time.perf_counter()
    model = build_rank(config, args.experts, device)
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    print(
        f"rank model: {built} of {total} layers, experts {args.experts}, {weight_bytes / 1e9:.1f} GB, built in "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    if args.expert_slice_gb is not None:
        from hsx.capture.quantized import experts as jit

        print(jit.set_slice(model, round(args.expert_slice_gb * 1e9), torch.bfloat16), flush=True)
    backend = TransformersBackend(model, default_layers(built), compiled=cuda)
    backend.set_packed(True)  # one padding-free row per batch, on the varlen attention kernel
    lengths = lognormal_lengths(args.samples, args.mean_len, args.min_len, args.max_len, seed=1)
    rng = np.random.default_rng(0)
    rows = [[rng.integers(0, config.vocab_size, n) for n in b] for b in batches(lengths, args.batch_tokens)]
    if len(rows) <= args.warm_up:
        raise SystemExit(
            f"error: --samples {args.samples} make {len(rows)} batch(es) of --batch-tokens {args.batch_tokens}, "
            f"and the warm-up takes {args.warm_up}: give more samples, or fewer warm-up batches"
        )
    t0 = time.perf_counter()
    for row in rows[: args.warm_up]:
        backend.forward(backend.inputs(row))
    sync(device)
    print(f"warm-up ({args.warm_up} batches, compiling) {time.perf_counter() - t0:.0f} s", flush=True)
    calls = dict(varlen.CALLS)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timed = rows[args.warm_up :]
    t0 = time.perf_counter()
    for row in timed:
        backend.forward(backend.inputs(row))
    sync(device)
    seconds = time.perf_counter() - t0
    kernel, single = (varlen.CALLS[k] - calls[k] for k in ("kernel", "per_sample"))
    print(f"timed: {len(timed)} batches; packed attention ran {kernel} varlen-kernel and {single} per-sample calls")
    tokens = sum(len(s) for row in timed for s in row)
    hidden = config.hidden_size
    est = NodeEstimate(
        layers_built=built,
        layers=total,
        tokens=tokens,
        seconds=seconds * total / built,
        allreduce_at_1=tokens * pace.allreduce_bytes(hidden * 2, args.ranks) / 1e9,
        mean_len=float(lengths.mean()),
        hidden=hidden,
        weight_bytes=weight_bytes,
        peak_bytes=torch.cuda.max_memory_allocated() if cuda else 0,
        handoff_at_1=tokens * Pace.handoff_bytes(hidden * 2, stage.handoff_states) / 1e9 if stage else 0.0,
    )
    if args.gpu_memory is not None:
        est.memory = stage_memory(args, model, built, total, est.peak_bytes)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for row in timed[:2]:
                backend.forward(backend.inputs(row))
            sync(device)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        Path(args.profile).write_text(table)
        print(table)
    return est


def stage_memory(args, model, built: int, total: int, peak: int) -> list[str]:
    """The whole stage (or rank) on a card of ``--gpu-memory`` GB: ``hsx memory``'s arithmetic of
    its layout, and what the ``built`` layers measured (``peak``: CUDA's peak allocation over the
    timed batches; 0 on CPU), their weights scaled to the stage's ``total`` layers."""
    from hsx.capture.memory import GB, HEADROOM, Inventory, Layout, gb

    inventory = Inventory.of(Path(args.model))
    if inventory is None:
        raise SystemExit(f"error: {args.model}: no weights, and no DeepSeek-V3 shapes in config.json to count")
    form = "dequantized" if args.experts == "bf16" else "packed"  # bf16: as if expanded at load
    layout = Layout(
        args.ranks, args.ranks, form, "bfloat16", args.batch_tokens, args.max_len,
        pipeline=args.pipeline, slice_gb=args.expert_slice_gb, expands=args.experts != "int4-gemm",
    )  # fmt: skip
    counted = inventory.estimate(layout)
    device = round(args.gpu_memory * GB)
    out = [f"memory, as hsx memory counts the whole {'stage' if args.pipeline > 1 else 'rank'}:"]
    out += counted.lines(device)
    layers = model.model.layers
    per_layer = sum(t.numel() * t.element_size() for t in [*layers[-1].parameters(), *layers[-1].buffers()])
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if peak:
        whole = peak + (total - built) * per_layer
        verdict = "fits" if whole <= device * (1 - HEADROOM) else "does NOT fit"
        out.append(
            f"measured: peak {gb(peak)} with {built} of {total} layers built ({gb(weights)} of weights); "
            f"with the other {total - built} layers' weights ({gb(per_layer)} each) the stage would peak at "
            f"{gb(whole)}: {verdict} {args.gpu_memory:g} GB; above its weights the peak is {gb(peak - weights)}, "
            f"against the arithmetic's activations and expansion, {gb(counted.activations + counted.expansion)}"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hsx.bench.node", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a folder with the model's config.json (weights are random)")
    p.add_argument("--device", default="cuda", help="cuda (timed figures) or cpu (a check of the arithmetic)")
    p.add_argument("--ranks", type=int, default=8, help="GPUs of a replica, or of each pipeline stage: TP = EP")
    p.add_argument("--pipeline", type=int, default=1, help="pipeline stages (the node has pipeline x ranks GPUs)")
    p.add_argument("--layers", type=int, default=0, help="build this many layers and scale (0: all)")
    p.add_argument(
        "--experts",
        choices=("int4", "int4-gemm", "fp8", "bf16"),
        default="int4",
        help="int4: packed, expanded per layer; int4-gemm: packed, read by a GEMM that dequantizes them (Triton); "
        "bf16: unquantized experts",
    )
    p.add_argument("--samples", type=int, default=64, help="samples timed (warm-up batches excluded)")
    p.add_argument("--mean-len", type=int, default=2200)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--warm-up", type=int, default=2, help="batches run first, untimed (compiling)")
    p.add_argument(
        "--allreduce-gbps", type=figures, help="all-reduce bus bandwidth, GB/s, or several a,b,c (state their source)"
    )
    p.add_argument("--p2p-gbps", type=figures, help="--pipeline: bandwidth between stages, GB/s, or several a,b,c")
    p.add_argument("--job-samples", type=int, default=37312, help="samples of the job whose hours are printed")
    p.add_argument("--profile", type=Path, help="write a profile of two batches of the rank's forward here")
    p.add_argument("--expert-slice-gb", type=float, help="expand each MoE layer's experts at most this many GB at once")
    p.add_argument("--gpu-memory", type=float, help="judge the whole stage (or rank) on a card of this many GB")
    args = p.parse_args(argv)
    if args.ranks > 1 and args.allreduce_gbps is None:
        p.error(f"--ranks {args.ranks} all-reduces: give --allreduce-gbps (and say where the figure comes from)")
    if args.pipeline > 1 and args.p2p_gbps is None:
        p.error(f"--pipeline {args.pipeline} hands batches on: give --p2p-gbps (and say where the figure comes from)")
    if args.pipeline < 1 or args.ranks < 1:
        p.error("--pipeline and --ranks take 1 or more")
    if args.expert_slice_gb is not None and args.expert_slice_gb <= 0:
        p.error("--expert-slice-gb takes GB above 0")
    if args.experts == "int4-gemm" and args.expert_slice_gb is not None:
        p.error("--expert-slice-gb slices the experts' expansion, and --experts int4-gemm expands none")
    if args.experts == "int4-gemm" and args.device != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        p.error("--experts int4-gemm runs a Triton kernel: on CUDA (or in its interpreter: TRITON_INTERPRET=1)")
    est = run(args)
    gpus = args.ranks * args.pipeline
    where = "stage" if args.pipeline > 1 else "rank"
    print(
        f"{where} forward {est.tokens:,} tokens in {est.seconds:.2f} s scaled to {est.layers} layers "
        f"(measured on {est.layers_built}); weights {est.weight_bytes / 1e9:.1f} GB, peak {est.peak_bytes / 1e9:.1f} "
        f"GB on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}"
    )
    for line in est.memory:
        print(line)
    layout = f"PP{args.pipeline} x TP{args.ranks}+EP{args.ranks}" if args.pipeline > 1 else ""
    layout = layout or f"one TP{args.ranks}+EP{args.ranks} replica"
    for allreduce in args.allreduce_gbps if args.ranks > 1 else [None]:
        for p2p in args.p2p_gbps if args.pipeline > 1 else [None]:
            said = [f"all-reduces {est.collective_seconds(allreduce):.2f} s at {allreduce:g} GB/s"] if allreduce else []
            said += [f"hand-offs {est.handoff_seconds(p2p):.2f} s at {p2p:g} GB/s"] if p2p else []
            tok_s = est.tok_s(allreduce, p2p)
            print(
                f"node ({gpus} GPUs, {layout}{': ' + ', '.join(said) if said else ''}): {tok_s:,.0f} tok/s, "
                f"{tok_s / est.mean_len:.2f} samples/s (mean {est.mean_len:.0f} tokens); {args.job_samples:,} "
                f"samples in {est.hours(args.job_samples, allreduce, p2p):.2f} h; stores "
                f"{est.storage_gb_per_hour(allreduce, p2p):,.0f} GB/h raw ({AUX_STATES} states x {est.hidden} x bf16 "
                "a token)"
            )


def figures(text: str) -> list[float]:
    """One bandwidth, or several comma-separated: each timed forward judged at every one."""
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"takes GB/s above 0, one or several a,b,c; not {text!r}")
    return values


if __name__ == "__main__":
    main()
