"""A target whose final norm matters, its own temperature-0 output, and the figures transformers'
own causal-LM forward gives: what the fidelity tests of every backend (``test_fidelity``,
``test_vllm``) hold a run's figures to."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from conftest import TINY, conversations, write_jsonl
from hsx.generate.job import generate
from hsx.generate.options import GenerateOptions
from hsx.store import layout
from hsx.store.format import decode

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def trained_norm(model, path: Path, seed: int = 0) -> Path:
    """Save ``model`` with a final norm as a trained model has one, its weights spread around 1 (a
    random model's are all ones: a norm of ones only scales each state, which no argmax sees), and the
    bundled tokenizer."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.model.norm.weight
        w.copy_(torch.empty(w.shape).log_normal_(0.0, 0.75, generator=g))
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, path / name)
    return path


def own_output(model: Path, out: Path, n: int = 12) -> Path:
    """A generate run of ``model`` at temperature 0: its own answers to the first questions of ``n``
    conversations."""
    rows = [row | {"conversations": row["conversations"][:2]} for row in conversations(n, start=40)]
    data = write_jsonl(out.parent / f"{out.name}.jsonl", rows)
    opts = GenerateOptions(
        out=out, model=str(model), data=[data], device="cpu", max_new_tokens=40, shard_size=100, turns="last"
    )
    generate(opts, log=lambda m: None)
    return out


def logits_reference(model_dir: Path, out: Path) -> dict[int, tuple[int, int, float]]:
    """Per sample, from transformers' own causal-LM forward (its logits, not hsx's head): the masked
    next tokens, those its argmax predicts, and the sum of their log-probabilities."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    found = {}
    for path in sorted((out / "shards").rglob("*.safetensors")):
        t = decode(path.read_bytes())
        ids, mask = t["input_ids"], t["loss_mask"].bool()
        with torch.no_grad():
            logits = model(ids[None]).logits[0, :-1]
        on = mask[1:]
        nxt = ids[1:][on]
        logp = torch.log_softmax(logits[on], -1).gather(1, nxt[:, None])[:, 0]
        found[layout.parse_sample_name(path.name)] = (
            int(on.sum()),
            int((logits[on].argmax(-1) == nxt).sum()),
            float(logp.sum()),
        )
    return found
