"""A conversation being regenerated: which steps the target takes, and the dataset's tool results
spliced in where its calls can be paired with them.

The dataset's messages fall into episodes: an assistant turn that follows a system or user turn,
with the assistant and tool turns after it up to the next system or user turn (plain chat: one
assistant turn each; agentic rows: calls, their results, more calls, the answer). Each episode to
regenerate starts on the dataset's turns before it, then every generation of the target is a step:

- a step without calls ends the episode; the dataset's next turns (the user's) follow;
- a step with calls gets, for each call in order, the first result of the same tool in the dataset's
  episode not used yet (parallel calls included), appended as ``tool`` turns, and the target
  generates again;
- a call that cannot be paired (a tool the episode has no result of, more calls than it has results
  of that tool, none left) ends the conversation there, with the reason: what came before it is the
  target's own and kept.

A result's tool is its ``name``, else the call its ``tool_call_id`` names, else the call in its
position after the assistant turn before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hsx.genrun.record import GeneratedTurn
from hsx.input import ToolCall

EPISODE = ("assistant", "tool")  # the roles of an episode's turns


def episode_starts(messages: list[dict]) -> list[int]:
    """The index of each episode's first assistant turn."""
    return [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and (i == 0 or messages[i - 1]["role"] not in EPISODE)
    ]


def episode_end(messages: list[dict], start: int) -> int:
    end = start
    while end < len(messages) and messages[end]["role"] in EPISODE:
        end += 1
    return end


def results_of(messages: list[dict]) -> list[tuple[str, dict]]:
    """An episode's tool results, each with the name of the tool it answers."""
    out: list[tuple[str, dict]] = []
    names: dict[str, str] = {}  # call id -> name
    calls: list[str] = []  # names of the calls of the last assistant turn, in order
    position = 0
    for m in messages:
        if m["role"] == "assistant":
            calls = [c["function"]["name"] for c in m.get("tool_calls") or []]
            names |= {c["id"]: c["function"]["name"] for c in m.get("tool_calls") or [] if c.get("id")}
            position = 0
        elif m["role"] == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id", ""))
            if not name and position < len(calls):
                name = calls[position]
            out.append((name or "", m))
            position += 1
    return out


def pair(calls: tuple[ToolCall, ...], results: list[tuple[str, dict]], offered: set[str]) -> list[dict] | str:
    """The dataset's results for ``calls`` (taken from ``results``, what is left of the episode's,
    whose tools were ``offered``), or why they cannot be paired."""
    answers = []
    for call in calls:
        k = next((k for k, (name, _) in enumerate(results) if name == call.name), None)
        if k is None:
            if call.name in offered:
                return f"the target called {call.name!r} more times than the dataset's turn has results of it"
            if not results:
                return f"the target called {call.name!r} and the dataset has no tool result left for this turn"
            return f"the target called {call.name!r}, a tool the dataset's turn has no result of"
        _, result = results.pop(k)
        named = {"name": call.name} if result.get("name") else {}  # a result the data serves unnamed stays so
        answers.append({"role": "tool", "content": result.get("content", ""), "tool_call_id": call.id} | named)
    return answers


@dataclass
class Dialogue:
    """``source``: the dataset's messages; ``targets``: the episodes to regenerate (their first
    message in ``source``); ``messages``: the conversation so far, as the next prompt renders it."""

    id: int
    source: list[dict]
    targets: list[int]
    tools: list[dict] | None = None
    messages: list[dict] = field(default_factory=list)
    done: list[GeneratedTurn] = field(default_factory=list)
    ended: str | None = None  # why the conversation stopped before its last episode's answer
    episode: int = 0
    results: list[tuple[str, dict]] = field(default_factory=list)  # this episode's, not used yet
    offered: set[str] = field(default_factory=set)  # the tools this episode has results of
    cursor: int = 0  # the next source message not yet in ``messages`` or passed over
    _text: str = ""  # the rendered text of the last prompt made

    def __post_init__(self) -> None:
        self._enter()

    @property
    def finished(self) -> bool:
        return self.ended is not None or self.episode == len(self.targets)

    @property
    def next_message(self) -> int:
        """The index the next generated turn takes in ``messages``."""
        return len(self.messages)

    def _enter(self) -> None:
        """Open the next episode: the dataset's turns before it, its results to pair."""
        if self.finished:
            return
        start = self.targets[self.episode]
        end = episode_end(self.source, start)
        self.messages += self.source[self.cursor : start]
        self.results = results_of(self.source[start:end])
        self.offered = {name for name, _ in self.results}
        self.cursor = end

    def step(self, message: dict, calls: tuple[ToolCall, ...]) -> None:
        """The target's turn is ``message``: splice the results of its calls, or end the episode."""
        self.messages.append(message)
        if not calls:
            self.episode += 1
            return self._enter()
        answers = pair(calls, self.results, self.offered)
        if isinstance(answers, str):
            self.ended = f"turn {len(self.messages) - 1}: {answers}"
        else:
            self.messages += answers

    def end(self, message: dict, reason: str) -> None:
        """The target's turn is ``message`` and the conversation cannot go on after it, for ``reason``."""
        self.messages.append(message)
        self.ended = f"turn {len(self.messages) - 1}: {reason}"
