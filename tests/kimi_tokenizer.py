"""A tokenizer laid out like Kimi-K2.5's, for the tests: a small ``tiktoken.model`` (byte-level BPE,
built here from the agentic rows' own words), a slow (Python) ``TikTokenTokenizer`` of the
repository's code loaded through ``auto_map`` (written for these tests, shaped as Moonshot's: special
tokens after the base vocabulary, named in ``added_tokens_decoder``; an ``apply_chat_template`` that
declares the tools to the template as TypeScript, ``tools_ts_str``), and Kimi-K2.5's chat template:
Kimi-K2-Thinking's (committed under tests/data/templates) with the tools block K2.5 adds, which
writes ``tools_ts_str`` where the tokenizer gives it and the JSON otherwise.

``KIMI_K2_IMPORT`` is the import Kimi-K2 / K2-Thinking's tokenizer code makes, which transformers 5
no longer serves (``bytes_to_unicode`` left the GPT-2 tokenizer module).
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

DATA = Path(__file__).parent / "data"
K2_THINKING = DATA / "templates" / "Kimi-K2-Thinking" / "chat_template.jinja"
SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
    "[UNK]",
    "[PAD]",
]
RESERVED = 256  # special-token ids after the base vocabulary, as Kimi's tokenizer reserves them
BASE = 1500  # base tokens: with the reserved ones, within the tiny models' vocabulary (2048)
PATTERN = r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
K25_IMPORT = "from transformers.convert_slow_tokenizer import bytes_to_unicode"
KIMI_K2_IMPORT = "from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode"

CODE = f'''"""TikTokenTokenizer: tiktoken BPE with special tokens after the base vocabulary; the chat template
is given the tools as TypeScript declarations (tools_ts_str)."""

import json
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
{K25_IMPORT}

PATTERN = {PATTERN!r}
RESERVED = {RESERVED}


def _ts_type(schema):
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return _ts_type(schema.get("items", {{}})) + "[]"
    if kind == "object":
        return _ts_object(schema, "  ")
    return {{"integer": "number", "number": "number", "string": "string", "boolean": "boolean"}}.get(kind, "any")


def _ts_object(schema, indent):
    required = set(schema.get("required", []))
    lines = []
    for name, prop in schema.get("properties", {{}}).items():
        if prop.get("description"):
            lines.append(f"{{indent}}// {{prop['description']}}")
        lines.append(f"{{indent}}{{name}}{{'' if name in required else '?'}}: {{_ts_type(prop)}},")
    return "{{\\n" + "\\n".join(lines) + "\\n" + indent[:-2] + "}}"


def tools_typescript(tools):
    """The tools as the TypeScript namespace the model was trained on."""
    out = ["# Tools", "", "## functions", "namespace functions {{"]
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("description"):
            out.append(f"// {{fn['description']}}")
        out.append(f"type {{fn['name']}} = (_: {{_ts_object(fn.get('parameters', {{}}), '  ')}}) => any;")
    return "\\n".join([*out, "}}"])


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {{"vocab_file": "tiktoken.model"}}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 added_tokens_decoder=None, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        names = {{int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {{}}).items()}}
        self.specials = {{names.get(i, f"<|reserved_token_{{i}}|>"): i for i in range(base, base + RESERVED)}}
        self.model = tiktoken.Encoding(Path(vocab_file).name, pat_str=PATTERN, mergeable_ranks=ranks,
                                       special_tokens=self.specials)
        chars = bytes_to_unicode()
        self.byte_decoder = {{c: b for b, c in chars.items()}}
        self.decoder = {{i: "".join(chars[b] for b in self.model.decode_single_token_bytes(i)) for i in range(base)}}
        self.decoder |= {{i: name for name, i in self.specials.items()}}
        self.encoder = {{t: i for i, t in self.decoder.items()}}
        self.vocab_file = vocab_file
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.model.encode(text, disallowed_special=())]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.specials.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        out = []
        for token in tokens:
            out.append(token.encode() if token in self.specials else bytes(self.byte_decoder[c] for c in token))
        return b"".join(out).decode("utf-8", "replace")

    def decode(self, token_ids, **kwargs):
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return (self.vocab_file,)

    def apply_chat_template(self, conversation, tools=None, **kwargs):
        if tools:
            kwargs["tools_ts_str"] = tools_typescript(tools)
        return super().apply_chat_template(conversation, tools=tools, **kwargs)
'''


def tokenizer_code(code_import: str = K25_IMPORT) -> str:
    """``tokenization_kimi.py``, importing ``bytes_to_unicode`` as ``code_import`` says."""
    return CODE.replace(K25_IMPORT, code_import)


def k25_template() -> str:
    """Kimi-K2.5's chat template: K2-Thinking's, its tools declared as ``tools_ts_str`` where given."""
    text = K2_THINKING.read_text()
    line = "  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson() }}<|im_end|>\n"
    assert line in text
    k25 = (
        "  {%- if tools_ts_str -%}\n  <|im_system|>tool_declare<|im_middle|>{{ tools_ts_str }}<|im_end|>\n"
        "  {%- else -%}\n" + line + "  {%- endif -%}\n"
    )
    return text.replace(line, k25)


def _ranks() -> list[bytes]:
    """The base vocabulary: every byte, then the agentic rows' most frequent words and marks, each
    after its prefixes (so that BPE reaches it), up to ``BASE`` tokens."""
    import regex

    words = Counter(regex.findall(PATTERN, (DATA / "agentic.jsonl").read_text()))
    out = [bytes([b]) for b in range(256)]
    seen = set(out)
    for word, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        raw = word.encode()
        for n in range(2, len(raw) + 1):
            if raw[:n] not in seen and len(out) < BASE:
                seen.add(raw[:n])
                out.append(raw[:n])
    return out


def kimi_tokenizer(path: Path, code_import: str = K25_IMPORT) -> Path:
    """The tokenizer files of a Kimi-K2.5-shaped checkpoint in ``path`` (made if missing):
    ``tiktoken.model``, ``tokenization_kimi.py`` (``code_import``: how it imports ``bytes_to_unicode``),
    ``tokenizer_config.json`` with its ``auto_map`` and special tokens, ``chat_template.jinja``."""
    path.mkdir(parents=True, exist_ok=True)
    ranks = _ranks()
    (path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(ranks))
    )
    (path / "tokenization_kimi.py").write_text(tokenizer_code(code_import))
    decoder = {
        str(len(ranks) + k): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True}
        for k, name in enumerate(SPECIALS)
    }  # fmt: skip
    config = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIALS[2:14],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "chat_template.jinja").write_text(k25_template())
    for stale in ("tokenizer.json", "special_tokens_map.json"):
        (path / stale).unlink(missing_ok=True)
    return path
