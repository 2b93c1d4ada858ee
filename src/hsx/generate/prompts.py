"""How each turn's prompt is made: the chat template renders the conversation so far, as extraction
renders it (``hsx.plan.Tokenize``, with the run's template keyword arguments), and the target's
earlier answers are kept token for token wherever the template keeps their text.

A conversation being generated (``generate.dialogue.Dialogue``) holds its messages so far: the
dataset's turns, the target's turns (its reasoning, content and calls, read back by
``generate.toolcalls`` as a server would) and the tool results spliced in. The prompt of the next
step is ``render(messages, add_generation_prompt, tools)``. Where that text begins with the previous
step's prompt text followed by the previous completion's text (a prefix-stable template that renders
the answer verbatim), the prompt is the previous prompt's ids, the previous completion's ids and the
ids of the rest: the target is conditioned on exactly the tokens it produced, not on a
re-tokenization of them, which need not give them back. Where the template changes the history
(drops reasoning, strips whitespace, writes calls with other spacing), the whole text is tokenized as
extraction would.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hsx.generate.dialogue import Dialogue
from hsx.generate.toolcalls import Malformed, Recognizer, from_message
from hsx.genrun.record import GeneratedTurn
from hsx.input import ToolCall, Turn, call_id, to_message
from hsx.plan import Tokenize


def stop_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """The tokens that end a turn: the checkpoint's generation config's eos ids and the tokenizer's
    eos (what vLLM and servers stop on too)."""
    ids: list[int] = []
    try:
        config = json.loads((model_dir / "generation_config.json").read_text())
        eos = config.get("eos_token_id")
        ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    except (OSError, ValueError):
        pass
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


class Prompter:
    """``stop_ids``: the tokens that end a turn (the engine stops on them); a completion's trailing
    stop token is not part of its message text. ``recognize``: how the target's reasoning and calls
    are read from its completions (``toolcalls``); None: a completion is the turn's content."""

    def __init__(self, tokenize: Tokenize, stop_ids: frozenset[int], recognize: Recognizer | None = None):
        self.tokenize, self.stop_ids, self.recognize = tokenize, stop_ids, recognize

    def prompt(self, d: Dialogue) -> np.ndarray:
        """The prompt ids of ``d``'s next turn."""
        text = self.tokenize.render(d.messages, True, d.tools)
        ids: list[int] | None = None
        if d.done:
            prev = d.done[-1]
            base = d._text + prev.text
            if text.startswith(base):
                body = self.body(prev.completion_ids)
                ids = [*prev.prompt_ids.tolist(), *body.tolist(), *self.tokenize.ids(text[len(base) :])]
        if ids is None:
            ids = self.tokenize.ids(text)
        d._text = text
        return np.asarray(ids, dtype=np.int32)

    def body(self, completion: np.ndarray) -> np.ndarray:
        """A completion without its final stop token."""
        return completion[:-1] if len(completion) and int(completion[-1]) in self.stop_ids else completion

    def text(self, completion: np.ndarray) -> str:
        return self.tokenize.tokenizer.decode(self.body(completion).tolist(), skip_special_tokens=False)

    def answer(
        self, d: Dialogue, prompt: np.ndarray, completion: np.ndarray, finish_reason: str, message: dict | None = None
    ) -> None:
        """Record the next turn's completion and put the target's turn (its reasoning, content and
        calls, as serving parses them; ``message``: as the engine parsed them) into the conversation;
        the dialogue pairs its calls."""
        text = self.text(completion)
        d.done.append(GeneratedTurn(d.next_message, prompt, completion, finish_reason, text))
        if self.recognize is None and message is None:
            return d.step({"role": "assistant", "content": text}, ())
        try:
            if message is not None:
                parsed = from_message(message)
            else:
                parsed = self.recognize(text, prompt.tolist(), self.body(completion).tolist(), d.tools)
        except Malformed as e:
            return d.end({"role": "assistant", "content": text}, f"the target's tool call does not parse ({e})")
        # calls without an id of the model's own get one that is the same on every run, as the data's do
        made = sum(len(m.get("tool_calls") or ()) for m in d.messages)
        calls = tuple(
            ToolCall(c.name, c.arguments, c.id or call_id(c.name, made + k)) for k, c in enumerate(parsed.calls)
        )
        d.step(to_message(Turn("assistant", parsed.content, parsed.reasoning, calls)), calls)
