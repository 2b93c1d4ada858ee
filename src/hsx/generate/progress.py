"""Progress of a generate run in figures an operator can check: conversations written and the new
tokens the engine produced (counted, not estimated), with the rate and ETA in conversations.

The plan's token estimate of each conversation still moves ``tokens_done`` (the metrics history and
``hsx status`` do their space arithmetic with it), but no rate or ETA is derived from it: how many
tokens a turn will produce is not known before it is generated.
"""

from __future__ import annotations

import time
from pathlib import Path

from hsx.progress import LOG_EVERY, Progress


class GenProgress(Progress):
    def __init__(self, bytes_per_token: int, where: Path | None = None, log_every: float = LOG_EVERY):
        super().__init__(0, 0, bytes_per_token, where, log_every)  # totals set once the plan is known
        self.turns = self.new_tokens = 0

    def clock(self) -> None:
        """Generation starts now: rates are over the engine's time, not the model load or verification."""
        self.t0 = time.monotonic()

    def add_conversation(self, estimate: int, turns: int, new_tokens: int, nbytes: int) -> None:
        """One conversation's file, durable now: ``turns`` generated with ``new_tokens`` in all."""
        with self.lock:
            self.turns += turns
            self.new_tokens += new_tokens
        self.add_written(estimate, nbytes)

    def rates(self) -> str:
        dt = max(self.elapsed(), 1e-9)
        return f"{self.samples / dt:,.2f} conv/s {self.new_tokens / dt:,.0f} new tok/s"

    def metrics(self) -> dict:
        dt = max(self.elapsed(), 1e-9)
        with self.lock:
            written, turns, new_tokens = self.samples, self.turns, self.new_tokens
            done = self.base_samples + written
        rate = written / dt
        return super().metrics() | {
            "conversations_done": done,
            "conversations_total": self.total_samples,
            "conversations_per_s": rate,
            "turns": turns,
            "new_tokens": new_tokens,
            "new_tokens_per_s": new_tokens / dt,
            "tokens_per_s": new_tokens / dt,  # what status shows as the run's tok/s: the engine's real output
            "eta_s": (self.total_samples - done) / rate if rate > 0 else None,
        }
