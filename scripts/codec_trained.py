"""Storage codecs on a trained model's states, not only random weights'.

Random-weight models lack the outlier dimensions (massive activations) of trained LLMs, which is
what a codec's ratio and fp8's error depend on. This trains the bundled tiny Llama for a few CPU
minutes on the bundled conversations (next-token loss, the first 400), then extracts the other 100
with every codec, for the random and the trained weights, in float32 and bfloat16, and prints:
stored / raw bytes of the sample files, fp8's error (max |x̂ - x| / amax of the token-layer, and RMS
error / RMS of the row), and how heavy the states' channels are (largest channel RMS / median
channel RMS, over the stored layers: trained LLMs reach 100x and more).

    python scripts/codec_trained.py [--steps 600] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hsx.plan import Plan
from hsx.store import layout
from hsx.store.codec import Codec
from hsx.store.format import decode
from hsx.tinymodel import bundled_path

ARGS = ("--shard-size", "50", "--batch-tokens", "4096", "--writers", "2", "--device", "cpu")


def extract(model: Path, data: Path, out: Path, *extra: str) -> None:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "hsx", "extract", "--model", str(model), "--data", str(data), "--out", str(out)]
    subprocess.run([*cmd, *ARGS, *extra], check=True, env=env, capture_output=True)


def files(run: Path) -> list[Path]:
    return sorted((run / layout.SHARDS).rglob("*.safetensors"))


def train(model_dir: Path, plan_run: Path, dest: Path, steps: int, seed: int = 0) -> tuple[float, float]:
    """Next-token training on the plan's token ids; saves the model (and the tokenizer) to ``dest``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    plan = Plan(plan_run)
    seqs = [torch.from_numpy(plan.input_ids(i).astype("int64"))[:512] for i in range(len(plan))]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        batch = [seqs[int(i)] for i in torch.randint(len(seqs), (8,), generator=g)]
        n = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.int64)
        labels = torch.full((len(batch), n), -100, dtype=torch.int64)
        mask = torch.zeros(len(batch), n, dtype=torch.int64)
        for b, s in enumerate(batch):
            ids[b, : len(s)], labels[b, : len(s)], mask[b, : len(s)] = s, s, 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    shutil.copytree(model_dir, dest)
    model.save_pretrained(dest)
    return sum(losses[:20]) / 20, sum(losses[-20:]) / 20


def measure(runs: dict[Codec, Path], layers: int) -> dict:
    raw_bytes = sum(p.stat().st_size for p in files(runs[Codec.RAW]))
    out = {str(c): sum(p.stat().st_size for p in files(r)) / raw_bytes for c, r in runs.items()}
    worst, rms, heavy = 0.0, [], []
    for a, b in zip(files(runs[Codec.RAW]), files(runs[Codec.FP8]), strict=True):
        x, y = decode(a.read_bytes()), decode(b.read_bytes())
        for name, groups in (("aux_hidden_states", layers), ("hidden_states", 1)):
            xs = x[name].float().view(x[name].shape[0], groups, -1)
            err = (y[name].float().view(xs.shape) - xs).abs()
            worst = max(worst, float((err / xs.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max()))
            rms.append(err.pow(2).mean(-1).sqrt() / xs.pow(2).mean(-1).sqrt().clamp_min(1e-30))
            if name == "aux_hidden_states":
                channel = xs.pow(2).mean(0).sqrt()  # [layers, H]
                heavy.append(channel.amax(-1) / channel.median(-1).values)
    out["fp8_max_err"] = worst
    out["fp8_rms_err"] = float(torch.cat([r.flatten() for r in rms]).mean())
    out["channel_max_over_median"] = float(torch.stack(heavy).amax())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hsx-codec-trained-", dir=args.workdir))
    t0 = time.perf_counter()
    try:
        rows = json.loads(bundled_path("data/sharegpt_dummy_conversation.json").read_text())
        train_data, test_data = root / "train.jsonl", root / "test.jsonl"
        train_data.write_text("".join(json.dumps(r) + "\n" for r in rows[:400]))
        test_data.write_text("".join(json.dumps(r) + "\n" for r in rows[400:]))
        tiny = bundled_path("tiny-llama")
        extract(tiny, train_data, root / "train-plan")  # the training token ids, tokenized as hsx does
        first, last = train(tiny, root / "train-plan", root / "trained", args.steps)
        print(f"trained {args.steps} steps (batches of 8, <= 512 tokens): loss {first:.2f} -> {last:.2f}")
        results = {}
        for weights, model in (("random", tiny), ("trained", root / "trained")):
            for dtype in ("float32", "bfloat16"):
                runs = {}
                for codec in Codec:
                    runs[codec] = root / f"{weights}-{dtype}-{codec}"
                    extract(model, test_data, runs[codec], "--dtype", dtype, "--codec", str(codec))
                results[(weights, dtype)] = measure(runs, 3)
        print(
            f"{'weights':<8} {'dtype':<9} {'zstd/raw':>9} {'fp8/raw':>8} {'fp8 max/amax':>13} {'fp8 rms':>8} "
            f"{'chan max/median':>16}"
        )
        for (weights, dtype), r in results.items():
            print(
                f"{weights:<8} {dtype:<9} {r['zstd']:>9.4f} {r['fp8']:>8.4f} {r['fp8_max_err']:>13.4f} "
                f"{r['fp8_rms_err']:>8.4f} {r['channel_max_over_median']:>16.1f}"
            )
        print(f"{time.perf_counter() - t0:.0f} s in all")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
