import numpy as np
import pytest

from conftest import TINY, conversations
from hsx.input import Conversation, Source, Turn, normalize
from hsx.plan import Plan, Tokenize, batches_for, tokenize_all, write_plan
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
