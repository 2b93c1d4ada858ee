import json
import re
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, conversations, with_text_arguments
from hsx.input import Conversation, Source, Turn, normalize, read_conversations, to_message, tools_of
from hsx.plan import Notes, Plan, Tokenize, batches_for, tokenize_all, write_plan
from hsx.target import load_tokenizer
from hsx.tinymodel import LLAMA3_TEMPLATE


def _tokenizer(template: str | None = None):
    tok = load_tokenizer(TINY, False)
    if template is not None:
        tok.chat_template = template
    return tok


def _chatml_pieces(turns):
    for t in turns:
        a = int(t.role == "assistant")
        yield f"<|im_start|>{t.role}\n", 0
        yield t.content, a
        yield "<|im_end|>", a
        yield "\n", 0


def _llama3_pieces(turns):
    yield "<|begin_of_text|>", 0
    for t in turns:
        a = int(t.role == "assistant")
        yield f"<|start_header_id|>{t.role}<|end_header_id|>\n\n", 0
        yield t.content.strip(), a
        yield "<|eot_id|>", a


def _expected(tok, pieces):
    """Ids and mask built piece by piece, independently of the prefix-rendering logic."""
    ids, mask = [], []
    for text, m in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [m] * len(piece)
    return np.array(ids), np.array(mask)


CUSTOM = [
    (("system", "You are terse."), ("user", "Hi"), ("assistant", "Hello! How can I help?")),
    (
        ("user", "2+2?"),
        ("assistant", "4"),
        ("user", "and 3+3?"),
        ("assistant", "  6, of course.  "),
        ("user", "thanks"),
        ("assistant", "You're welcome."),
    ),
    (("user", "last turn is a question"), ("assistant", "ok"), ("user", "why?")),
]


def _convs():
    out = [normalize(r, Source("f", i, "")) for i, r in enumerate(conversations(6, start=10))]
    out += [Conversation(Source("c", i, ""), tuple(Turn(r, c) for r, c in turns)) for i, turns in enumerate(CUSTOM)]
    assert len({len(c.turns) for c in out}) >= 3  # single- and multi-turn
    return out


@pytest.mark.parametrize(("template", "pieces"), [(None, _chatml_pieces), (LLAMA3_TEMPLATE, _llama3_pieces)])
def test_loss_mask_is_exactly_assistant_content_and_end_of_turn(template, pieces):
    tok = _tokenizer(template)
    tokenize = Tokenize(tok, max_length=10_000)
    for conv in _convs():
        (sample,) = tokenize(conv).samples
        ids, mask = _expected(tok, pieces(conv.turns))
        assert sample.input_ids.tolist() == ids.tolist()
        assert sample.loss_mask.tolist() == mask.tolist()
        assert not sample.truncated


def test_truncation_is_marked_and_a_mask_without_assistant_tokens_is_rejected():
    tok = _tokenizer()
    conv = _convs()[-2]  # six turns
    (full,) = Tokenize(tok, 10_000)(conv).samples
    (cut,) = Tokenize(tok, 20)(conv).samples
    assert cut.truncated and len(cut.input_ids) == 20
    assert cut.input_ids.tolist() == full.input_ids[:20].tolist()
    long_question = Conversation(Source("x", 0, ""), (Turn("user", "word " * 200), Turn("assistant", "ok")))
    (reject,) = tokenize_all([long_question], Tokenize(tok, 16))
    assert "no assistant token within the first 16 tokens" in reject.reason


def test_plan_round_trip_and_fingerprint(tmp_path):
    tok = _tokenizer()
    convs = _convs()
    info, rejects = write_plan(tmp_path, tokenize_all(convs, Tokenize(tok, 64)), 64)
    plan = Plan(tmp_path)
    assert rejects == [] and len(plan) == len(convs) == info.num_samples
    assert plan.fingerprint() == info.fingerprint
    (direct,) = Tokenize(tok, 64)(convs[3]).samples
    assert plan.input_ids(3).tolist() == direct.input_ids.tolist()
    assert plan.loss_mask(3).tolist() == direct.loss_mask.tolist()
    assert int(plan.lengths.sum()) == info.num_tokens
    assert plan.truncated.sum() == info.num_truncated > 0


def test_batches_are_deterministic_length_sorted_and_within_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, size=100)
    batches = batches_for(range(100), lengths, budget=1024)
    again = batches_for(reversed(range(100)), lengths, budget=1024)
    assert batches == again
    assert sorted(i for b in batches for i in b.ids) == list(range(100))
    for b in batches:
        assert b.padded_tokens <= 1024 or len(b.ids) == 1
        assert b.max_len == max(lengths[list(b.ids)])
    assert any(len(b.ids) > 1 for b in batches)


# ---------------------------------------------------------------- agentic and reasoning conversations

DATA = Path(__file__).parent / "data"
# vLLM's tool chat templates (Apache-2.0, beside their license), and the marker each ends a turn with
TEMPLATES = {
    "hermes": ("tool_chat_template_hermes.jinja", ("<|im_end|>",)),
    "deepseekv3": ("tool_chat_template_deepseekv3.jinja", ("<｜end▁of▁sentence｜>",)),
    "hyperclovax": ("tool_chat_template_hyperclovax_seed_think_14b.jinja", ("<|endofturn|>", "<|stop|>")),
}


def _starts(name: str, t: Turn) -> str:
    """What the target writes first in turn ``t`` under template ``name`` (read off the templates)."""
    if name == "hyperclovax":  # after its prompt "<|im_start|>assistant"
        return f"/think\n{t.reasoning}" if t.reasoning else "\n" + t.content if t.content else " -> tool/function_call"
    if t.tool_calls:
        return "<tool_call>" if name == "hermes" else t.content + "<｜tool▁calls▁begin｜>"
    return t.content


MARKERS = ("USERQ", "SYSP", "TOOLRES", "TOOLDESC")  # in every user, system, tool result and tool schema of the data


def _agentic() -> list[Conversation]:
    return [c for c in read_conversations([DATA / "agentic.jsonl"]) if isinstance(c, Conversation)]


def _runs(tok, sample) -> list[str]:
    """The decoded text of each maximal masked run of a sample."""
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    out, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize("name", TEMPLATES)
def test_masks_hold_what_the_target_generates_and_nothing_else(name):
    """Checked against the rows themselves: every assistant turn is one masked run ending in the
    template's end marker; the runs hold each call's name and arguments, each answer and, where
    the template renders it, the reasoning; never a user, system, tool result or tools block."""
    file, ends = TEMPLATES[name]
    tok = _tokenizer((DATA / "templates" / file).read_text())
    tokenize = Tokenize(tok, 10_000)
    reasons_rendered = name == "hyperclovax"
    for conv in _agentic():
        if name == "hermes" and conv.source.id in ("toolace", "hermes-fc"):  # results of calls written as text
            with pytest.raises(Exception, match="require a 'name' key"):  # hermes' own demand, so a reject
                tokenize(conv)
            continue
        done = tokenize(conv)
        assistant = [t for t in conv.turns if t.role == "assistant"]
        runs = [r for s in done.samples for r in _runs(tok, s)]
        assert len(runs) == len(assistant), conv.source.id  # parallel calls of one turn: one run
        masked = "".join(runs)
        assert all(r.rstrip().endswith(ends) for r in runs), (conv.source.id, runs)
        for t in assistant:  # each run starts where the target starts writing (a token may carry blanks before)
            assert any(r.lstrip(" ").startswith(_starts(name, t).lstrip(" ")) for r in runs), (conv.source.id, runs)
        assert not any(m in masked for m in MARKERS), (conv.source.id, masked)
        text = tok.decode(np.concatenate([s.input_ids for s in done.samples]).tolist())
        for t in conv.turns:  # the context is rendered, unmasked (a marker's phrase survives JSON escaping)
            if t.role != "assistant":
                assert re.search(r"(USERQ|SYSP|TOOLRES)[^\"\\]*", t.content).group() in text
        dropped_content = 0
        for t in assistant:
            for call in t.tool_calls:
                assert call.name in masked
                for key, value in json.loads(call.arguments).items():
                    assert f'"{key}": {json.dumps(value)}' in masked, (conv.source.id, masked)
            if t.content and t.content.strip() not in masked:
                assert name == "hermes" and t.tool_calls and t.content not in text  # hermes drops it beside calls
                dropped_content += 1
            if t.reasoning:
                assert (t.reasoning in masked) == reasons_rendered and (t.reasoning in text) == reasons_rendered
        counts = done.notes.counts
        assert counts.get("content_unrendered", 0) == dropped_content
        reasoning = sum(bool(t.reasoning) for t in assistant)
        assert counts.get("reasoning_unrendered", 0) == (0 if reasons_rendered else reasoning)
        assert "calls_unrendered" not in counts and "tool_results_unrendered" not in counts
        assert "tools_unrendered" not in counts
        # vLLM's Hermes template requires each result's name: given the called tool's, where the row has none
        unnamed = any(t.role == "tool" and not t.name for t in conv.turns)
        assert counts.get("result_names_given", 0) == int(name == "hermes" and unnamed), (conv.source.id, counts)


def test_a_turn_the_template_renders_otherwise_later_gets_a_sample_of_its_own():
    """HyperCLOVA X's template drops an answer's reasoning once a new question follows: the full
    conversation masks the last turn, the first turn is extracted as transformers renders the
    conversation up to it (the reference), its reasoning masked."""
    tok = _tokenizer((DATA / "templates" / TEMPLATES["hyperclovax"][0]).read_text())
    conv = next(c for c in _agentic() if c.source.id == "reason-multiturn")
    done = Tokenize(tok, 10_000)(conv)
    assert done.notes.counts == {"own_sample_turns": 1}
    full, own = done.samples
    messages = [to_message(t) for t in conv.turns]
    for sample, upto in ((full, 4), (own, 2)):
        ref = tok.apply_chat_template(messages[:upto], tokenize=False)
        assert sample.input_ids.tolist() == tok(ref, add_special_tokens=False)["input_ids"]
    assert _runs(tok, own) == ["/think\nSeventeen threes: thirty plus twenty-one gives fifty-one.<|im_end|>\n"
                               "<|im_start|>assistant\n51.<|im_end|><|endofturn|>"]  # fmt: skip
    assert "Seventeen" not in tok.decode(full.input_ids.tolist())
    # a limit that the last turn starts at: the whole conversation has nothing left to extract,
    # the first turn's own sample still has its turn; the lost turn is counted, not dropped silently
    limit = int(np.argmax(full.loss_mask))
    cut = Tokenize(tok, limit)(conv)
    assert cut.notes.counts == {"own_sample_turns": 1, "past_max_length_turns": 1}
    assert [s.input_ids.tolist() for s in cut.samples] == [own.input_ids[:limit].tolist()]
    assert _runs(tok, full) == ["/think\nFifty-one and nine make sixty.<|im_end|>\n"
                                "<|im_start|>assistant\n60.<|im_end|><|endofturn|>"]  # fmt: skip


def test_the_plan_counts_what_the_template_leaves_out_and_names_metadata(tmp_path):
    """The bundled ChatML template renders no tools, calls or reasoning: the plan says so."""
    tok = _tokenizer()
    convs = _agentic()
    info, rejects = write_plan(tmp_path, tokenize_all(convs, Tokenize(tok, 4096)), 4096)
    assert rejects == [] and info.num_samples == len(convs)
    tool_rows = [c for c in convs if c.tools]
    calls = [call for c in convs for t in c.turns for call in t.tool_calls]
    thinking = [t for c in convs for t in c.turns if t.reasoning]
    assert info.rendering == {
        "reasoning_unrendered": len(thinking),
        "calls_unrendered": len(calls),
        "tools_unrendered": len(tool_rows),
        "call_ids_given": sum(c.ids_given for c in convs),
    }
    assert len(thinking) == 13 and len(calls) == 13 and len(tool_rows) == 8 and info.rendering["call_ids_given"] == 10
    assert info.ignored_fields == {"category": 2, "messages[].name": 1, "messages[].weight": 1, "subcategory": 1}
    assert Plan(tmp_path).info == info  # recorded with the plan
    meta = tmp_path / "plan" / "plan.json"
    old = {k: v for k, v in json.loads(meta.read_text()).items() if k not in ("rendering", "ignored_fields")}
    meta.write_text(json.dumps(old))  # a plan written before hsx counted: read, with nothing counted
    assert (Plan(tmp_path).info.rendering, Plan(tmp_path).info.ignored_fields) == ({}, {})
    lines = info.summary()
    assert "13 assistant turns' reasoning the chat template does not render" in lines
    assert any(
        line.startswith("13 tool calls the chat template does not render (by name and argument values")
        for line in lines
    )
    assert any(
        line.startswith("10 tool calls without an id in the data, given one (functions.NAME:N") for line in lines
    )
    assert lines[-1] == (
        "metadata fields no template reads, not rendered: category (2 rows), messages[].name (1 rows), "
        "messages[].weight (1 rows), subcategory (1 rows)"
    )
    # a template that renders no tool turn: every tool result is counted
    skipping = (
        "{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenize = Tokenize(_tokenizer(skipping), 4096)
    counted = sum(
        n.counts.get("tool_results_unrendered", 0) for n in tokenize_all(convs, tokenize) if isinstance(n, Notes)
    )
    assert counted == sum(t.role == "tool" for c in convs for t in c.turns) == 13


# ---------------------------------------------------------------- the templates users serve: real public ones

EOS = "<|im_end|>"  # the bundled tokenizer's eos_token, which Mistral's template writes after a turn
DS_END = "<｜end▁of▁sentence｜>"
# template file; the marker ending each turn it writes (GLM's turn ends at the next turn's role token,
# none of its own); whose reasoning it renders as the latest turn; and the rows it refuses, in its words
FAMILIES = {
    "kimi-k2-thinking": (
        "Kimi-K2-Thinking/chat_template.jinja", (EOS,), lambda t: bool(t.tool_calls), {}
    ),  # answers: an empty <think></think>, always; a tool loop's calls keep theirs
    "gpt-oss": ("gpt-oss-20b.jinja", ("<|return|>", "<|call|>"), lambda t: True, {
        "toolace": "Message has tool role, but there was no previous assistant message with a tool call!",
        "hermes-fc": "Message has tool role, but there was no previous assistant message with a tool call!",
    }),
    "qwen3": ("Qwen3.jinja", (EOS,), lambda t: True, {}),
    "glm-4.6": ("GLM-4.6/chat_template.jinja", None, lambda t: True, {}),
    "llama-3.1-json": ("tool_chat_template_llama3.1_json.jinja", ("<|eot_id|>",), lambda t: False, {
        "openai-parallel": "This model only supports single tool-calls at once!",
        "glaive-parallel": "This model only supports single tool-calls at once!",
        "xlam": "This model only supports single tool-calls at once!",
    }),
    "mistral-small-3.1": ("Mistral-Small-3.1-24B-Instruct-2503.jinja", (EOS,), lambda t: False, {
        "openai-parallel": "Tool call IDs should be alphanumeric strings with length >= 9! (1)call_a1",
        "openai-tools-string": "Tool call IDs should be alphanumeric strings with length >= 9! (1)call_s1",
        "toolace": "'dict object' has no attribute 'tool_call_id'",  # results of calls written as text: no id
        "hermes-fc": "'dict object' has no attribute 'tool_call_id'",
    }),
    "glm-4.7": ("GLM-4.7-Flash/chat_template.jinja", None, lambda t: True, {}),
    "qwen3-coder": ("Qwen3-Coder.jinja", (EOS,), lambda t: False, {}),
    "deepseek-v3.1": ("DeepSeek-V3.1/chat_template.jinja", (DS_END,), lambda t: False, {}),  # arguments as text
    "deepseek-v3.1-vllm": ("tool_chat_template_deepseekv31.jinja", (DS_END,), lambda t: False, {}),
    "deepseek-v3.2-vllm": ("tool_chat_template_deepseekv32.jinja", (DS_END,), lambda t: False, {}),
    "minimax-m2": ("MiniMax-M2/chat_template.jinja", ("[e~[",), lambda t: True, {
        "toolace": "Message has tool role, but there was no previous assistant message with a tool call!",
        "hermes-fc": "Message has tool role, but there was no previous assistant message with a tool call!",
    }),
}  # fmt: skip
TEXT_ARGUMENTS = {"deepseek-v3.1"}  # families whose template concatenates a call's arguments as text


def _served(message: dict) -> dict:
    """A message as a server hands it to the template: the reasoning under each name templates read."""
    r = message.get("reasoning_content")
    return message | {"thinking": r, "reasoning": r} if r else message


def _in(value: object, text: str) -> bool:
    """An argument's keys and scalar values are all in ``text`` (as text or as JSON)."""
    if isinstance(value, dict):
        return all(k in text and _in(v, text) for k, v in value.items())
    return value in text if isinstance(value, str) else json.dumps(value) in text


@pytest.mark.parametrize("family", FAMILIES)
def test_real_templates_mask_each_turn_after_its_served_prompt_as_the_template_writes_it(family):
    """Every assistant turn is one masked run, after exactly the prompt the target was served for it
    (transformers' rendering of the turns before it with the generation prompt) and as the template's
    rendering of the conversation up to it ends: in the whole conversation where the template writes
    it there so, else in a later turn's sample or its own. Each run is checked against the row: its
    calls' names and argument values, its content and its reasoning where the template renders them
    (what it leaves out is counted, turn by turn), never a user, system, tool result or tools block."""
    file, ends, keeps_reasoning, refused = FAMILIES[family]
    tok = _tokenizer((DATA / "templates" / file).read_text())
    tokenize = Tokenize(tok, 100_000)
    for conv in _agentic():
        if conv.source.id in refused:  # what no rendering can express, in the template's own words
            with pytest.raises(Exception, match=re.escape(refused[conv.source.id])):
                tokenize(conv)
            continue
        done = tokenize(conv)
        messages, tools = [_served(to_message(t)) for t in conv.turns], tools_of(conv)
        as_text = family in TEXT_ARGUMENTS and any(t.tool_calls for t in conv.turns)
        assert done.notes.counts.get("text_arguments_rows", 0) == as_text, (conv.source.id, done.notes.counts)
        messages = with_text_arguments(messages) if as_text else messages
        turns = [i for i, t in enumerate(conv.turns) if t.role == "assistant"]
        render = partial(tok.apply_chat_template, tools=tools, tokenize=False)
        prompt = {i: render(messages[:i], add_generation_prompt=True) for i in turns}
        upto = {i: render(messages[: i + 1]) for i in turns}
        runs: dict[int, str] = {}
        texts = []
        for sample in done.samples:
            text = tok.decode(sample.input_ids.tolist())
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            assert enc["input_ids"] == sample.input_ids.tolist()
            texts.append(text)
            at = np.flatnonzero(np.diff(np.concatenate([[0], sample.loss_mask, [0]])))
            for a, b in zip(at[::2], at[1::2], strict=True):  # each masked run: tokens a..b-1
                (sa, first_end), eb = enc["offset_mapping"][a], enc["offset_mapping"][b - 1][1]
                (i,) = [i for i in turns if text.startswith(prompt[i]) and sa <= len(prompt[i]) < first_end]
                assert i not in runs, (conv.source.id, i)
                runs[i] = text[len(prompt[i]) : eb]
                assert upto[i].rstrip().endswith(runs[i].rstrip()), (conv.source.id, i, runs[i])
        assert sorted(runs) == turns, conv.source.id
        counts = done.notes.counts
        dropped = Counter()
        for i in turns:
            t, run = conv.turns[i], runs[i]
            assert not any(m in run for m in MARKERS), (conv.source.id, run)
            assert ends is None or run.rstrip().endswith(ends), (conv.source.id, run)
            if t.reasoning:
                assert (t.reasoning in run) == keeps_reasoning(t), (family, conv.source.id, run)
            inline = t.content.split("</think>")[0].split("<think>")[-1].strip() if "</think>" in t.content else ""
            reasoning = t.reasoning or inline  # inline reasoning DeepSeek's templates cut off the answer
            dropped["reasoning_unrendered"] += bool(reasoning) and reasoning not in run
            answer = t.content.split("</think>")[-1].strip()  # inline reasoning as Qwen3's and GLM's read it
            dropped["content_unrendered"] += answer not in run
            at = 0
            for call in t.tool_calls:
                found = run.find(call.name, at)
                shown = found >= 0 and _in(json.loads(call.arguments), run)
                at = found + len(call.name) if shown else at
                dropped["calls_unrendered"] += not shown
        for key in ("reasoning_unrendered", "content_unrendered", "calls_unrendered"):
            assert counts.get(key, 0) == dropped[key], (family, conv.source.id, key, counts)
        for t in conv.turns:  # the context is rendered, unmasked (a marker's phrase survives JSON escaping)
            if t.role != "assistant":
                phrase = re.search(r"(USERQ|SYSP|TOOLRES)[^\"\\]*", t.content).group()
                assert any(phrase in text for text in texts), (conv.source.id, phrase)
        assert "tool_results_unrendered" not in counts
        tools_shown = any("TOOLDESC" in text for text in texts)  # in every tool's description
        assert counts.get("tools_unrendered", 0) == (bool(conv.tools) and not tools_shown), (conv.source.id, counts)
        assert tools_shown or family == "deepseek-v3.1" or not conv.tools  # it renders no tools block
        calls = [c for i in turns for c in conv.turns[i].tool_calls]
        if family == "gpt-oss":  # its template writes the first call of a turn only
            assert dropped["calls_unrendered"] == sum(max(len(conv.turns[i].tool_calls) - 1, 0) for i in turns)
        elif family == "kimi-k2-thinking":  # it writes a call by its id: one not of its form shows no name
            assert dropped["calls_unrendered"] == sum(not c.id.startswith(f"functions.{c.name}:") for c in calls)
        else:
            assert dropped["calls_unrendered"] == 0
        if family in ("qwen3", "glm-4.6"):  # they reformat inline reasoning, and render all of it
            assert not counts.get("content_unrendered") and not counts.get("reasoning_unrendered"), counts


def test_the_kimi_thinking_agent_row_is_extracted_as_kimi_serves_it():
    """The story's traffic under Kimi-K2-Thinking's template: user, a call with reasoning, its result,
    an answer with reasoning. The call is masked as Kimi writes it (reasoning, its call by the id
    hsx gave it); the answer after the prompt Kimi was served, which keeps the call's reasoning though
    the template's rendering of the whole conversation drops it; the answer's reasoning, which no
    rendering of this template holds, is counted. One sample holds both turns."""
    tok = _tokenizer((DATA / "templates" / FAMILIES["kimi-k2-thinking"][0]).read_text())
    conv = next(c for c in _agentic() if c.source.id == "story")
    done = Tokenize(tok, 10_000)(conv)
    (sample,) = done.samples
    messages, tools = [to_message(t) for t in conv.turns], tools_of(conv)
    served = tok.apply_chat_template(messages[:4], tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<think>I need the current weather in Oslo first.</think>" in served
    assert "I need the current weather" not in tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert tok.decode(sample.input_ids.tolist()) == served + "<think></think>Yes: 21 C and sunny.<|im_end|>"
    assert _runs(tok, sample) == [
        "<think>I need the current weather in Oslo first.</think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>",
        "<think></think>Yes: 21 C and sunny.<|im_end|>",
    ]
    assert done.notes.counts == {"reasoning_unrendered": 1, "own_sample_turns": 2, "call_ids_given": 1}


@pytest.mark.parametrize(
    ("file", "kwargs", "prompt_end", "run"),
    [
        ("Qwen3.jinja", {"enable_thinking": False}, "<think>\n\n</think>\n\n", "No: 91 = 7 x 13.<|im_end|>"),
        ("GLM-4.6/chat_template.jinja", {"enable_thinking": False}, "<think></think>", "\nNo: 91 = 7 x 13."),
        ("DeepSeek-R1-Distill-Qwen-32B/chat_template.jinja", {}, "<think>\n", "No: 91 = 7 x 13.<｜end▁of▁sentence｜>"),
    ],
)  # fmt: skip
def test_text_the_prompt_forces_is_context_and_a_turn_that_cannot_follow_it_is_counted(file, kwargs, prompt_end, run):
    """A template told not to think (its prompt forces an empty reasoning block) or one that forces the
    reasoning open (DeepSeek-R1): the turn is masked right after its prompt as served, forced text
    included; the row's reasoning, which cannot follow that prompt, is counted, and where the template
    writes the turn without the forced text at all, that is counted too."""
    tok = _tokenizer((DATA / "templates" / file).read_text())
    conv = next(c for c in _agentic() if c.source.id == "reason-thinking")
    done = Tokenize(tok, 10_000, kwargs)(conv)
    (sample,) = done.samples
    served = tok.apply_chat_template([to_message(conv.turns[0])], tokenize=False, add_generation_prompt=True, **kwargs)
    assert served.endswith(prompt_end) and tok.decode(sample.input_ids.tolist()).rstrip() == served + run
    assert _runs(tok, sample) == [run]
    unforced = {"unforced_turns": 1} if "DeepSeek" in file else {}
    assert done.notes.counts == {"reasoning_unrendered": 1, "own_sample_turns": 1} | unforced


def test_a_template_that_concatenates_the_arguments_as_text_is_given_them_as_text_and_counted():
    """DeepSeek-R1-Distill's template (as DeepSeek-V3.1's official one) writes a call's arguments by
    concatenating them as text: given the objects serving engines hand templates, every tool row was
    rejected ("can only concatenate str (not "dict") to str"). Each now renders with the arguments as
    their JSON text, exactly as transformers renders that form, the calls masked, and the rows counted;
    a template that fails on both forms is a reject naming both errors."""
    tok = _tokenizer((DATA / "templates" / "DeepSeek-R1-Distill-Qwen-32B" / "chat_template.jinja").read_text())
    tokenize = Tokenize(tok, 100_000)
    tool_rows = [c for c in _agentic() if any(t.tool_calls for t in c.turns)]
    assert len(tool_rows) == 8
    dropped = 0  # its rendering of a turn after a tool result drops a second turn's calls (multi-step)
    for conv in tool_rows:
        done = tokenize(conv)
        assert done.notes.counts["text_arguments_rows"] == 1, conv.source.id
        messages = with_text_arguments([to_message(t) for t in conv.turns])
        render = partial(tok.apply_chat_template, tools=tools_of(conv), tokenize=False, add_generation_prompt=True)
        served = {render(messages[:i]) for i, t in enumerate(conv.turns) if t.role == "assistant"}
        for sample in done.samples:  # each turn masked right after the prompt served with text arguments
            ids = sample.input_ids.tolist()
            starts = np.flatnonzero(np.diff(np.concatenate([[0], sample.loss_mask])) == 1)
            assert all(tok.decode(ids[:a]) in served for a in starts), conv.source.id
        masked = "".join(r for s in done.samples for r in _runs(tok, s))
        calls = [call for t in conv.turns for call in t.tool_calls]
        shown = sum(f"{call.name}\n```json\n{call.arguments}\n```" in masked for call in calls)
        assert len(calls) - shown == done.notes.counts.get("calls_unrendered", 0), (conv.source.id, masked)
        dropped += len(calls) - shown
    assert dropped == 1
    plain = next(c for c in _agentic() if c.source.id == "plain-openai")
    assert "text_arguments_rows" not in tokenize(plain).notes.counts
    both = (  # objects fail its concatenation, text its keys()
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.keys() | list | join(',')"
        " + c.function.arguments }}{% endfor %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(Exception, match=r"can only concatenate .* \(as the row has it\); ") as e:
        Tokenize(_tokenizer(both), 1000)(tool_rows[0])
    assert "has no attribute 'keys' (with the calls' arguments as JSON text)" in str(e.value)


@pytest.mark.parametrize(
    "file",
    [
        "tool_chat_template_deepseekv3.jinja",
        "Hermes-3-Llama-3.1-8B/tool_use.jinja",
        "tool_chat_template_deepseekv31.jinja",
        "tool_chat_template_deepseekv32.jinja",
    ],
)
def test_each_turns_context_is_the_prompt_served_byte_for_byte(file):
    """vLLM's DeepSeek-V3, V3.1 and V3.2 tool templates write other blanks around a turn in the whole
    conversation than after its generation prompt, Hermes-3's after tool results: the tokens before each masked
    turn are exactly the prompt the target was served (transformers' rendering of the turns before it
    with the generation prompt, tokenized), never the whole rendering's blanks; the turns where the two
    differ are counted."""
    tok = _tokenizer((DATA / "templates" / file).read_text())
    tokenize = Tokenize(tok, 100_000)
    counted = differs = 0
    for conv in _agentic():
        if "Hermes" in file and not conv.tools:
            continue  # its tool_use template renders rows with tools (default renders the others)
        try:
            done = tokenize(conv)
        except Exception:
            continue  # rows the template refuses: test_masks_hold_what_the_target_generates_and_nothing_else
        messages, tools = [to_message(t) for t in conv.turns], tools_of(conv)
        render = partial(tok.apply_chat_template, tools=tools, tokenize=False)
        turns = [i for i, t in enumerate(conv.turns) if t.role == "assistant"]
        served = {i: render(messages[:i], add_generation_prompt=True) for i in turns}
        starts = []
        for sample in done.samples:
            ids = sample.input_ids.tolist()
            for a in np.flatnonzero(np.diff(np.concatenate([[0], sample.loss_mask])) == 1):
                (i,) = [i for i in turns if ids[:a] == tok(served[i], add_special_tokens=False)["input_ids"]]
                starts.append(i)
        assert sorted(starts) == turns, conv.source.id
        differs += sum(not render(messages[: i + 1]).startswith(served[i]) for i in turns)
        counted += done.notes.counts.get("served_blanks_turns", 0)
    assert counted > 0 and counted <= differs
