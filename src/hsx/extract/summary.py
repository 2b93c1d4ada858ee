"""What an extraction did, in its own words: ``ExtractSummary`` (the job's ``Summary`` with tokens,
bytes, rejects and the time the model waited for the disk)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hsx.job.resume import Summary
from hsx.spec import RunSpec
from hsx.store import layout

# the disk-pace advice of a summary: only for a run this long, whose forward pass waited this share of it
DISK_ADVICE_RUN_S, DISK_ADVICE_SHARE = 60.0, 0.05


@dataclass
class ExtractSummary(Summary):
    total_tokens: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    rejected: int = 0
    waited_for_disk: float = 0.0  # seconds the forward pass waited for writes: > a few % means the disk is the limit

    @classmethod
    def of(cls, run: Path, spec: RunSpec) -> ExtractSummary:
        return cls(run, spec.plan.num_samples, total_tokens=spec.plan.num_tokens, rejected=spec.plan.num_rejected)

    def own_lines(self) -> list[str]:
        """The disk-pace advice only where acting on it changes the run's time materially."""
        rate = f" ({self.tokens_written / self.seconds:,.0f} tok/s)" if self.seconds > 0 and self.tokens_written else ""
        mb = self.bytes_written / 1e6
        lines = [
            f"samples    {self.done}/{self.total_samples} done, {self.written} written now, "
            f"{self.already_done} were already verified",
            f"written    {self.tokens_written:,} tokens, {mb:,.1f} MB in {self.seconds:.1f}s{rate}",
            f"rejected   {self.rejected} input rows (see {self.run / layout.REJECTS})",
        ]
        if self.seconds > DISK_ADVICE_RUN_S and self.waited_for_disk > DISK_ADVICE_SHARE * self.seconds:
            lines.append(
                f"disk       the model waited {self.waited_for_disk:.1f}s ({self.waited_for_disk / self.seconds:.0%}) "
                "for writes to finish: writing, not the forward pass, set the pace (a faster volume or more --writers)"
            )
        v = self.verified
        if v is not None and v.files:
            waited = f"extraction waited {v.waited:.1f}s for it"
            then = waited if self.written else "nothing to extract: no model loaded"
            read = f"{v.bytes / 1e9:,.2f} GB in {v.seconds:.1f}s ({v.rate / 1e9:.2f} GB/s)"
            lines.append(f"verified   {v.files:,} files, {read}; {then}")
        return lines

    def add(self, other: ExtractSummary) -> None:
        super().add(other)
        self.tokens_written += other.tokens_written
        self.bytes_written += other.bytes_written
