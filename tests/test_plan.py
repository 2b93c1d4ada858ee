import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, conversations
from hsx.input import Conversation, Source, Turn, normalize, read_conversations, to_message
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
    calling = [t for c in convs for t in c.turns if t.tool_calls]
    thinking = [t for c in convs for t in c.turns if t.reasoning]
    assert info.rendering == {
        "reasoning_unrendered": len(thinking),
        "calls_unrendered": len(calling),
        "tools_unrendered": len(tool_rows),
    }
    assert len(thinking) == 4 and len(calling) == 4 and len(tool_rows) == 4
    assert info.ignored_fields == {"category": 2, "messages[].name": 1, "messages[].weight": 1, "subcategory": 1}
    assert Plan(tmp_path).info == info  # recorded with the plan
    meta = tmp_path / "plan" / "plan.json"
    old = {k: v for k, v in json.loads(meta.read_text()).items() if k not in ("rendering", "ignored_fields")}
    meta.write_text(json.dumps(old))  # a plan written before hsx counted: read, with nothing counted
    assert (Plan(tmp_path).info.rendering, Plan(tmp_path).info.ignored_fields) == ({}, {})
    lines = info.summary()
    assert "4 assistant turns' reasoning the chat template does not render" in lines
    assert "4 assistant turns' tool calls the chat template does not render" in lines
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
    assert counted == sum(t.role == "tool" for c in convs for t in c.turns) == 8
