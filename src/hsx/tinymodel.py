"""The bundled tiny target: a random-weight Llama with a real byte-level BPE tokenizer.

It exists so that the quickstart, the tests and the CPU benchmark run offline in seconds. The
bundle is committed under ``hsx/bundled/tiny-llama``; ``python -m hsx.tinymodel DEST`` rebuilds
it deterministically from the bundled conversations.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def bundled_path(name: str) -> Path:
    """Path of a file or folder shipped inside the package (``data/...`` or ``tiny-llama``)."""
    return Path(str(resources.files("hsx") / "bundled" / name))


def _corpus() -> list[str]:
    rows = json.loads(bundled_path("data/sharegpt_dummy_conversation.json").read_text())
    texts = [turn["value"] for row in rows for turn in row["conversations"]]
    for line in bundled_path("data/mt_bench_question.jsonl").read_text().splitlines():
        texts.extend(json.loads(line)["turns"])
    return texts


def build_tokenizer(vocab_size: int = 2048):
    """Train a byte-level BPE on the bundled text; deterministic for a given tokenizers version."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def tiny_config(vocab_size: int, num_layers: int = 8):
    from transformers import LlamaConfig

    # head_dim 32: the smallest size every attention backend (including vLLM's CPU one) accepts.
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build(dest: Path, seed: int = 0) -> Path:
    """Write a tokenizer and a random-weight float32 Llama to ``dest``."""
    import torch
    from transformers import LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(dest)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(len(tokenizer))).to(torch.float32)
    model.save_pretrained(dest)
    return dest


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
