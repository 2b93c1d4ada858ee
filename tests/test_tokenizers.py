"""The tokenizer a checkpoint ships, planned through its own class: slow (Python) and remote-code
tokenizers such as Kimi-K2.5's ``TikTokenTokenizer`` (``kimi_tokenizer``), whose tokens have no
character offsets, masked as exactly as with a fast tokenizer's offsets; the tools declared as its
class renders them (TypeScript); the class and files recorded; a tokenizer whose code cannot run
refused by name before anything is written. References: the class's own ``apply_chat_template``
and tokenization, and the offsets of a fast tokenizer on the same text."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import TINY, hsx, require, write_jsonl
from hsx.errors import TokenizerError
from hsx.extract import ExtractOptions, extract
from hsx.fingerprint import digest_json
from hsx.generate.engines.base import Completion, Engine, Request
from hsx.generate.job import generate
from hsx.generate.options import GenerateOptions
from hsx.genrun.record import read_record
from hsx.input import Conversation, read_conversations, to_message, tools_of
from hsx.plan import Plan, Tokenize
from hsx.store import layout
from hsx.target import load_tokenizer
from hsx.tinymodel import CHATML_TEMPLATE
from kimi_fixtures import kimi_k25, language_model_reference
from kimi_tokenizer import KIMI_K2_IMPORT, kimi_tokenizer, tokenizer_code

DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "templates"
AGENTIC = DATA / "agentic.jsonl"
OPENER = "<|im_assistant|>assistant<|im_middle|>"  # Kimi's generation prompt: the turn follows it
ROWS = ("story", "openai-parallel", "multi-turn-tools", "reason-multiturn", "plain-openai")


def _agentic(ids=None) -> list[Conversation]:
    rows = [c for c in read_conversations([AGENTIC]) if isinstance(c, Conversation)]
    return [c for c in rows if ids is None or c.source.id in ids]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The maximal masked runs of a sample, as token ranges."""
    at = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(at[::2].tolist(), at[1::2].tolist(), strict=True))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    """The tiny Kimi-K2.5 composite as released, with its TikToken tokenizer and repository code."""
    require("tiktoken")
    root = tmp_path_factory.mktemp("k25")
    model = kimi_k25(language_model_reference(root / "reference"), root / "kimi", torch.float32)
    for name in ("tokenizer.json", "chat_template.jinja"):
        (model / name).unlink()
    return kimi_tokenizer(model)


# ---------------------------------------------------------------- token boundaries without offsets


SPACED = (  # a generation prompt that ends in a blank: the turn's first token holds it (" Hello")
    "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.mark.parametrize(
    "template",
    [SPACED, "Qwen3.jinja", "tool_chat_template_deepseekv3.jinja", "GLM-4.6/chat_template.jinja"],
)
def test_without_offsets_the_masks_are_those_offsets_give(template, monkeypatch):
    """The same fast tokenizer planned twice, by its offsets and as a tokenizer without any: every
    sample's ids and mask are the same, on templates whose turns start after a special token, inside
    blanks the template leaks (DeepSeek-V3's) or in a token that also holds the prompt's blank, where
    the pieces' tokens are not the whole's and the cut is placed by decoding."""
    tok = load_tokenizer(TINY, False)
    tok.chat_template = template if template == SPACED else (TEMPLATES / template).read_text()
    by_offsets, by_pieces = Tokenize(tok, 100_000), Tokenize(tok, 100_000)
    by_pieces.offsets = False
    decoded = []
    original = Tokenize._decoded_cuts
    monkeypatch.setattr(Tokenize, "_decoded_cuts", lambda self, *a: decoded.append(1) or original(self, *a))
    compared = 0
    for conv in _agentic():
        try:
            want = by_offsets(conv)
        except Exception as e:  # a row the template refuses is refused either way
            with pytest.raises(type(e)):
                by_pieces(conv)
            continue
        got = by_pieces(conv)
        assert got.notes == want.notes
        for a, b in zip(want.samples, got.samples, strict=True):
            assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
            compared += 1
    assert compared >= 14
    assert (len(decoded) > 0) == (template == SPACED), len(decoded)


# ---------------------------------------------------------------- Kimi-K2.5's own tokenizer, end to end


def test_kimi_k25_is_planned_and_extracted_with_its_own_slow_tokenizer(kimi, tmp_path):
    """docs/kimi.md's command (on one CPU process): the run plans with the repository's
    TikTokenTokenizer, through its own apply_chat_template, so the tools are declared as the
    TypeScript it serves (never the template's JSON fallback); every masked run is one assistant turn,
    after exactly the ids the class gives the prompt it was served, and is the turn as the template
    writes it; the spec names the class and its files."""
    rows = [json.loads(line) for line in AGENTIC.read_text().splitlines()]
    data = write_jsonl(tmp_path / "convs.jsonl", [r for r in rows if r.get("id") in ROWS])
    out = tmp_path / "k25"
    proc = hsx("extract", "--model", kimi, "--data", data, "--out", out, "--trust-remote-code", "--device", "cpu")
    assert "tokenizer TikTokenTokenizer (slow), the repository's tokenization_kimi.TikTokenTokenizer" in proc.stderr
    spec = json.loads((out / layout.SPEC).read_text())
    assert spec["tokenizer"]["tokenizer_class"] == (
        "TikTokenTokenizer (slow), the repository's tokenization_kimi.TikTokenTokenizer"
    )
    assert sorted(spec["tokenizer"]["files"]) == [
        "chat_template.jinja",
        "tiktoken.model",
        "tokenization_kimi.py",
        "tokenizer_config.json",
    ]
    tok = load_tokenizer(kimi, True)
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    plan = Plan(out)
    by_source = {}
    for i in range(len(plan)):
        by_source.setdefault(plan.sources.column("source_id")[i].as_py(), []).append(i)
    convs = _agentic(ROWS)
    assert sorted(by_source) == sorted(c.source.id for c in convs)
    for conv in convs:
        messages, tools = [to_message(t) for t in conv.turns], tools_of(conv)
        turns = [i for i, t in enumerate(conv.turns) if t.role == "assistant"]
        render = partial(tok.apply_chat_template, tools=tools, tokenize=False)
        served = {i: render(messages[:i], add_generation_prompt=True) for i in turns}
        upto = {i: render(messages[: i + 1]) for i in turns}
        found = []
        for k in by_source[conv.source.id]:
            ids, mask = plan.input_ids(k).tolist(), plan.loss_mask(k)
            for a, b in _runs(mask):
                (i,) = [i for i in turns if tok.decode(ids[:a]) == served[i]]
                assert ids[:a] == tok(served[i], add_special_tokens=False)["input_ids"], (conv.source.id, i)
                assert tok.decode(ids[a:b]) == upto[i][upto[i].rindex(OPENER) + len(OPENER) :], (conv.source.id, i)
                found.append(i)
        assert sorted(found) == turns, conv.source.id
        if tools:
            assert "namespace functions {" in served[turns[0]] and '"parameters"' not in served[turns[0]]
        for t in conv.turns:  # a result served without a name is written under its role, none invented
            if t.role == "tool" and not t.name:
                assert f"<|im_system|>tool<|im_middle|>## Return of {t.tool_call_id}\n{t.content}" in served[turns[-1]]
    assert spec["plan"]["num_samples"] == len(plan)


def test_a_repository_tokenizer_is_refused_by_name_before_anything_is_written(kimi, tmp_path):
    """Without --trust-remote-code, and with Kimi-K2's tokenizer code, which imports
    bytes_to_unicode from where transformers 5 no longer has it: each refused (exit 2: a refusal)
    with what to do, and no run folder made."""
    data = write_jsonl(tmp_path / "convs.jsonl", [json.loads(AGENTIC.read_text().splitlines()[0])])
    out = tmp_path / "run"
    opts = ExtractOptions(out=out, model=str(kimi), data=[data], device="cpu")
    with pytest.raises(TokenizerError) as refused:
        extract(opts, log=lambda m: None)
    assert str(refused.value).endswith(
        "the tokenizer is the repository's code (tokenization_kimi.TikTokenTokenizer, by auto_map in "
        "tokenizer_config.json): pass --trust-remote-code to run it (hsx runs the tokenizer's code only)"
    )
    assert refused.value.exit_code == 2 and not out.exists()
    k2 = tmp_path / "kimi-k2"
    k2.mkdir()
    for p in kimi.iterdir():
        (k2 / p.name).symlink_to(p)
    (k2 / "tokenization_kimi.py").unlink()
    (k2 / "tokenization_kimi.py").write_text(tokenizer_code(KIMI_K2_IMPORT))
    opts = ExtractOptions(out=out, model=str(k2), data=[data], device="cpu", trust_remote_code=True)
    with pytest.raises(TokenizerError) as refused:
        extract(opts, log=lambda m: None)
    said = str(refused.value)
    assert "the repository's tokenizer code (tokenization_kimi.py) does not import under transformers 5." in said
    assert "cannot import name 'bytes_to_unicode' from 'transformers.models.gpt2.tokenization_gpt2'" in said
    assert said.endswith(
        "The fix: change that import in tokenization_kimi.py to where transformers "
        f"{transformers.__version__} has bytes_to_unicode (from transformers.convert_slow_tokenizer import "
        "bytes_to_unicode, as Kimi-K2.5's tokenization_kimi.py imports it)"
    )
    assert not out.exists()


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    tok = load_tokenizer(TINY, False)
    tok.chat_template = None
    with pytest.raises(TokenizerError, match=r"the tokenizer \(TokenizersBackend\) has no chat template"):
        Tokenize(tok, 100)


def test_a_template_that_does_not_compile_is_refused_before_anything_is_written(tmp_path):
    """vLLM's DeepSeek-V3.1 tool template had a Jinja syntax error at one commit
    (``{% set tool_json = tool | tojson}``): every row was rejected with the same "unexpected '}'".
    Now the start is refused, naming the template's error and line, and nothing is written."""
    from conftest import conversations

    model = shutil.copytree(TINY, tmp_path / "model")
    template = model / "chat_template.jinja"
    template.write_text(
        "{% for tool in tools or [] %}{% set tool_json = tool | tojson}{% endfor %}" + template.read_text()
    )
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    opts = ExtractOptions(out=tmp_path / "run", model=str(model), data=[data], device="cpu")
    with pytest.raises(TokenizerError, match=r"chat template does not compile: .*'}'.* \(line 1\); fix the template"):
        extract(opts, log=lambda _: None)
    assert not (tmp_path / "run").exists()


CALL = (
    "<think>I need the weather first.</think><|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
)
ANSWER = "<think>Twenty-one is warm there.</think>Yes, 21 C."


class KimiTarget(Engine):
    """A target scripted by its prompt, writing Kimi's markup: a call, then, once served the
    result, an answer; each turn ended by <|im_end|> (Kimi's generation config's eos)."""

    name, version, max_pending = "scripted", "1", 4

    def __init__(self, tok):
        self.tok, self.queue = tok, []

    def submit(self, request: Request) -> None:
        self.queue.append(request)

    def poll(self, timeout=None) -> list:
        out, self.queue = [self._answer(r) for r in self.queue], []
        return out

    def _answer(self, r: Request) -> Completion:
        text = ANSWER if "## Return of" in self.tok.decode(list(r.prompt_ids)) else CALL
        ids = [*self.tok(text, add_special_tokens=False)["input_ids"], self.tok.convert_tokens_to_ids("<|im_end|>")]
        return Completion(r.key, r.prompt_ids, tuple(ids), "stop")

    def close(self) -> None:
        pass


def test_hsx_generate_round_trips_kimis_calls_through_its_own_tokenizer(kimi, tmp_path, monkeypatch):
    """hsx generate with Kimi-K2.5's slow tokenizer and the kimi_k2 parser: the target's call is read
    back (name, arguments, its own id), answered with the row's result, and the next prompt is the
    class's rendering of the conversation so far, holding the ids the target produced as it made
    them (the template writes its call back as generated)."""
    tok = load_tokenizer(kimi, True)
    model = tmp_path / "kimi"
    model.mkdir()
    for p in kimi.iterdir():
        (model / p.name).symlink_to(p)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.convert_tokens_to_ids("<|im_end|>")}))
    rows = [json.loads(line) for line in AGENTIC.read_text().splitlines()]
    data = write_jsonl(tmp_path / "story.jsonl", [r for r in rows if r.get("id") == "story"])
    monkeypatch.setattr("hsx.generate.job.open_engine", lambda name, settings: KimiTarget(tok))
    out = tmp_path / "gen"
    opts = GenerateOptions(out=out, model=str(model), data=[data], tool_parser="kimi_k2", trust_remote_code=True)
    assert generate(opts, log=lambda m: None).complete
    (rec,) = [read_record(p, 0) for p in (out / "shards").rglob("*.safetensors")]
    assert rec.ended is None and [m["role"] for m in rec.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    call = rec.messages[2]
    assert call["reasoning_content"] == "I need the weather first."
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in call["tool_calls"]] == [
        ("functions.get_weather:0", "get_weather", {"city": "Oslo"})
    ]
    assert rec.messages[3]["content"] == "TOOLRES 21 C and sunny"
    assert (
        rec.messages[4]["reasoning_content"] == "Twenty-one is warm there."
        and rec.messages[4]["content"] == "Yes, 21 C."
    )
    first, second = rec.turns
    served = tok.apply_chat_template(rec.messages[:4], tools=rec.tools, tokenize=False, add_generation_prompt=True)
    assert tok.decode(second.prompt_ids.tolist()) == served and "namespace functions {" in served
    n = len(first.prompt_ids)
    assert second.prompt_ids[: n + len(first.completion_ids)].tolist() == [
        *first.prompt_ids.tolist(),
        *first.completion_ids.tolist(),
    ]


# ---------------------------------------------------------------- named chat templates


@pytest.fixture(scope="module")
def hermes(tmp_path_factory) -> Path:
    """The tiny model with its chat templates laid out as Hermes-3's tokenizer_config.json has them:
    a list of named ones, ``default`` (ChatML: the bundled template) and ``tool_use`` (Hermes-3's own)."""
    path = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(TINY, path)
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": CHATML_TEMPLATE},
        {"name": "tool_use", "template": (TEMPLATES / "Hermes-3-Llama-3.1-8B" / "tool_use.jinja").read_text()},
    ]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_named_templates_render_as_transformers_picks_them_and_the_choice_is_recorded(hermes, tmp_path):
    """Hermes-3's named templates: hsx extract plans (it crashed digesting the dict), each row rendered
    with tool_use where it offers tools, else with default, as transformers and serving engines pick;
    the spec records the templates' digest and the choice, the plan counts the rows of each. With
    --chat-template NAME every row renders with that one; a name the tokenizer lacks is refused by
    name, the names it has listed, before anything is written."""
    rows = [json.loads(line) for line in AGENTIC.read_text().splitlines()]
    data = write_jsonl(tmp_path / "convs.jsonl", [r for r in rows if r.get("id") in ("story", "plain-openai")])
    out = tmp_path / "run"
    proc = hsx("extract", "--model", hermes, "--data", data, "--out", out, "--device", "cpu")
    assert "plan: the tokenizer's named chat templates (default, tool_use): tool_use for rows with tools" in proc.stderr
    spec = json.loads((out / layout.SPEC).read_text())
    tok = load_tokenizer(hermes, False)
    assert spec["tokenizer"]["chat_template"] == digest_json(tok.chat_template) and spec["chat_template"] is None
    assert spec["plan"]["rendering"]["tool_use_template_rows"] == 1
    plan = Plan(out)
    texts = {plan.sources.column("source_id")[i].as_py(): tok.decode(plan.input_ids(i).tolist()) for i in range(2)}
    story, plain = _agentic(["story"])[0], _agentic(["plain-openai"])[0]
    render = partial(tok.apply_chat_template, tokenize=False)
    assert texts["story"] == render(
        [to_message(t) for t in story.turns], tools=tools_of(story), chat_template="tool_use"
    )
    assert "<tools>" in texts["story"] and texts["plain-openai"] == render([to_message(t) for t in plain.turns])
    forced = Tokenize(tok, 10_000, template="default")(story)  # the row's tools then go unrendered, counted
    assert tok.decode(forced.samples[0].input_ids.tolist()) == render(
        [to_message(t) for t in story.turns], tools=tools_of(story), chat_template="default"
    )
    assert forced.notes.counts["tools_unrendered"] == 1 and "tool_use_template_rows" not in forced.notes.counts
    again = tmp_path / "named"
    with pytest.raises(TokenizerError) as refused:
        extract(ExtractOptions(out=again, model=str(hermes), data=[data], chat_template="nope"), log=lambda m: None)
    assert str(refused.value) == (
        "--chat-template nope: the tokenizer has no chat template of that name (its named templates are "
        "default, tool_use)"
    )
    assert not again.exists()
