"""What a generation backend is to the generate job: requests in, completions out, in any order.

The job keeps up to ``Engine.max_pending`` requests submitted (so a continuously batching engine
stays full) and reads finished ones with ``poll``. A conversation's next turn is submitted only
when its previous turn's completion came back, since its prompt holds that completion. Every
request carries the exact prompt token ids; every completion gives back the prompt ids the engine
ran and the completion ids it produced, so nothing downstream re-tokenizes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn; part of the generate run's spec (a resume with other sampling is refused)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_new_tokens: int = 2048


@dataclass(frozen=True)
class Capabilities:
    """What an engine does itself, which the generate stage reads (before the engine is open, from its
    module's ``capabilities(settings)``; after, from ``Engine.capabilities``) instead of asking which
    engine it is."""

    # it renders each prompt from ``Request.chat`` with its own template: the prompt ids it reports
    # having run are the turn's, whatever hsx's rendering of the same messages gave
    renders_chat: bool = False
    parses_tool_calls: bool = False  # it reads reasoning and tool calls out of its answers (``Completion.message``)
    returns_token_ids: bool = True  # it gives back the prompt and completion ids it ran (the job needs them)


def ids_only(settings) -> Capabilities:
    """An engine that runs the prompt ids it is given and returns the ids it generated: hsx renders
    each prompt and parses each answer."""
    return Capabilities()


@dataclass(frozen=True)
class Request:
    """One turn to generate. ``key`` is unique in the run (conversation key, turn, sample); ``seed``
    is derived from the run's seed and the key, so a redone request draws as the first try did."""

    key: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    seed: int
    # for an engine that renders the chat (``Capabilities.renders_chat``): JSON of {"messages", "tools",
    # "template_kwargs"}
    chat: str | None = None


@dataclass(frozen=True)
class Completion:
    key: str
    prompt_ids: tuple[int, ...]  # as the engine ran them: must equal the request's
    completion_ids: tuple[int, ...]
    finish_reason: FinishReason
    message: dict | None = None  # an engine that parses tool calls: the answer as its parsers read it


@dataclass(frozen=True)
class Failure:
    """The engine gave up on a request (after its own retries): the conversation becomes a reject."""

    key: str
    reason: str


Outcome = Completion | Failure


class Engine(ABC):
    """One backend. ``name`` and ``version`` go into the run spec (a resume on another engine is refused)."""

    name: str
    version: str
    max_pending: int = 1
    capabilities: Capabilities = Capabilities()  # what it does itself: its module's ``capabilities(settings)``

    @abstractmethod
    def submit(self, request: Request) -> None:
        """Queue one request; never blocks on the model."""

    @abstractmethod
    def poll(self, timeout: float | None = None) -> list[Outcome]:
        """Outcomes finished since the last poll; waits up to ``timeout`` (None: until at least one) while
        requests are pending, returns [] at once when none are."""

    @abstractmethod
    def close(self) -> None:
        """Release the model or connections."""
