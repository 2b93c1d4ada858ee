"""A tiny target whose predictions depend on context, for the trainers' held-out controls.

The bundled tiny Llama has random weights: its next token is mostly a function of the current one,
which a draft sees anyway, so a draft trained on its states hardly beats one trained on shuffled
states. This target is trained on sequences of words where each word is a fixed permutation of the
word two before it (``next = RULE[token two back]``), so its prediction at a position is not a
function of that position's token: a draft can learn it only from the target's states there.

It is a real transformers model that hsx extracts like any other: a Qwen3ForCausalLM of the bundled
model's shapes (8 layers, hidden 64) with the bundled tokenizer and chat template, and a native MTP
head (``mtp.*`` weights, as Qwen3-Next and Qwen3.5 ship theirs; random here, for the trainer to
fine-tune) beside it. Conversations: the user gives the first words, the assistant continues them.

    python tests/context_target.py tests/data/context-target

rebuilds it (about a minute on two CPU cores; deterministic for a given torch on one thread).
``conversations`` makes the data, a held-out set with another seed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CONTEXT_TARGET = HERE / "data" / "context-target"
# words that are one token each of the bundled tokenizer (checked in ``build``)
WORDS = (  # noqa: SIM905 (a sentence of them reads better than 24 quoted lines)
    "you the from and can have more any day help ask too nice today with for are your was name that about each one"
).split()
USER_WORDS = 4  # the prompt: the sequence's first words
TRAIN_WORDS = 56  # the assistant's words in training sequences; ``conversations`` gives 24 to 56
STEPS, BATCH, LR = 400, 32, 3e-3


def rule() -> list[int]:
    """The permutation of the words: word t+1 is ``rule()[word t-1]``."""
    return torch.randperm(len(WORDS), generator=torch.Generator().manual_seed(0)).tolist()


def row(g: torch.Generator, answer: int) -> dict:
    """A ShareGPT row: the user gives the first words, the assistant ``answer`` more. The first two
    words are random, each next one the rule of the one two before it."""
    f = rule()
    x = torch.randint(len(WORDS), (2,), generator=g).tolist()
    while len(x) < USER_WORDS + answer:
        x.append(f[x[-2]])
    words = [WORDS[i] for i in x]
    turns = [" ".join(["", *words[:USER_WORDS]]), " ".join(["", *words[USER_WORDS:]])]
    return {"conversations": [{"from": "human", "value": turns[0]}, {"from": "gpt", "value": turns[1]}]}


def conversations(n: int, seed: int) -> list[dict]:
    """n ShareGPT rows whose assistants answer 24 to 56 words."""
    g = torch.Generator().manual_seed(seed)
    return [row(g, int(torch.randint(24, TRAIN_WORDS + 1, (1,), generator=g))) for _ in range(n)]


def config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def mtp_head(cfg) -> dict[str, torch.Tensor]:
    """A native MTP head's weights under the names Qwen3-Next and Qwen3.5 checkpoints give them
    (``mtp.fc`` over [token embedding, hidden], its norms, one decoder layer), randomly initialized."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    layer = Qwen3DecoderLayer(cfg, layer_idx=0)
    for name, p in layer.named_parameters():
        if not name.endswith("norm.weight"):
            torch.nn.init.normal_(p, std=cfg.initializer_range)
    h = cfg.hidden_size
    head = {f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    head["mtp.fc.weight"] = torch.randn(h, 2 * h) * cfg.initializer_range
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        head[f"mtp.{norm}.weight"] = torch.ones(h)
    return head


def tokenized(tokenizer, rows: list[dict]) -> torch.Tensor:
    """The rows rendered by the chat template, as the extraction renders them: [n, T] (one length)."""
    ids = [
        tokenizer.apply_chat_template(
            [
                {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in r["conversations"]
            ],
            tokenize=True,
            return_dict=False,
        )
        for r in rows
    ]
    return torch.tensor(ids)


def train_rows(n: int, seed: int) -> list[dict]:
    """Training rows of one length (no padding): the assistant answers TRAIN_WORDS words."""
    g = torch.Generator().manual_seed(seed)
    return [row(g, TRAIN_WORDS) for _ in range(n)]


def build(dest: Path, seed: int = 0) -> float:
    """Train the target and write it, a random MTP head beside it and the bundled tokenizer to
    ``dest``. Returns its accuracy on held-out assistant words (every one follows the rule)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from hsx.tinymodel import bundled_path  # here: the data and the path import without hsx (Automodel's env)

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tiny = bundled_path("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert all(len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1 for w in WORDS)
    data, held = tokenized(tokenizer, train_rows(4096, seed + 1)), tokenized(tokenizer, train_rows(256, seed + 2))
    prompt = [{"role": "user", "content": train_rows(1, seed)[0]["conversations"][0]["value"]}]
    start = len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False))
    cfg = config()
    model = Qwen3ForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS, pct_start=0.1)
    g = torch.Generator().manual_seed(seed + 3)
    for step in range(STEPS):
        ids = data[torch.randint(len(data), (BATCH,), generator=g)]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    with torch.no_grad():
        predicted = model(input_ids=held).logits.argmax(-1)
    # the assistant's words (then <|im_end|> and a newline), each predicted at the position before it
    accuracy = float((predicted[:, start - 1 : -3] == held[:, start:-2]).float().mean())
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    save_file(
        load_file(dest / "model.safetensors") | mtp_head(cfg), dest / "model.safetensors", metadata={"format": "pt"}
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, dest / name)
    return accuracy


if __name__ == "__main__":
    print(f"held-out accuracy on the assistant's words: {build(Path(sys.argv[1])):.4f}")
