"""What a trainer format is, and what it writes with: the export's options, its context (run,
plan, final norm), and durable files recorded with their size and digest.

Each trainer module subclasses ``TrainerFormat``; ``core`` drives them through a run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from hsx.bounds import EXPORT
from hsx.errors import ExportRefused, NormUnavailable, OptionError
from hsx.export.norm import load_final_norm, norm_error, prenorm_from_post, tolerance
from hsx.finalnorm import FinalNorm
from hsx.plan import Plan
from hsx.spec import RunSpec
from hsx.store.codec import is_lossless
from hsx.store.durable import write_durable
from hsx.store.format import digest
from hsx.target import location, model_dir_for


@dataclass
class ExportOptions:
    run: Path
    dest: Path
    to: str
    model: str | None = None  # model folder for the final norm / vocab size (default: the spec's path)
    prenorm: bool = False  # modelopt: export the pre-norm final state (flagged hidden_states_prenorm)
    allow_incomplete: bool = False  # export the samples that are done instead of refusing
    draft_vocab: int | None = None  # also write the trainer's draft-vocab map of this size
    target_vocab: int | None = None  # target vocabulary size (default: the model's config)
    pace: float = 0.0  # seconds to sleep after each sample (throttling; lets tests kill mid-export)

    def __post_init__(self) -> None:
        """Refuse a value out of its bound, or one that would be ignored, before anything is read."""
        EXPORT.check(self)
        if self.target_vocab is not None and self.draft_vocab is None:
            raise OptionError("--target-vocab sizes the draft-vocab map of --draft-vocab, which is not given")

    def command(self) -> str:
        """This export as a command line that works from any directory (it continues a stopped one)."""
        args = ["hsx", "export", self.run.absolute(), self.dest.absolute(), "--to", self.to]
        args += ["--model", location(self.model)] if self.model is not None else []
        args += ["--prenorm"] if self.prenorm else []
        args += ["--draft-vocab", self.draft_vocab] if self.draft_vocab is not None else []
        args += ["--target-vocab", self.target_vocab] if self.target_vocab is not None else []
        args += ["--allow-incomplete"] if self.allow_incomplete else []
        return shlex.join(map(str, args))

    def extract_command(self) -> str:
        """The resume that redoes the run's damaged samples (with this export's --model, if given)."""
        args = ["hsx", "extract", "--out", self.run.absolute()]
        args += ["--model", location(self.model)] if self.model is not None else []
        return shlex.join(map(str, args))


@dataclass(frozen=True)
class Written:
    path: str  # relative to DEST
    size: int
    digest: str

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "digest": self.digest}


def put(dest: Path, rel: str, data: bytes) -> Written:
    """Write one file of the export durably; what the progress log and manifest record of it."""
    path = dest / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    size = write_durable(path, data)
    return Written(rel, size, digest(data))


@dataclass
class Context:
    """Everything a trainer format needs while writing: the run, its plan, the final norm."""

    opts: ExportOptions
    spec: RunSpec
    plan: Plan
    ids: list[int]  # sample id of each export index
    norm: FinalNorm | None = None
    prenorm_source: str = ""  # how the pre-norm state is obtained, for the manifest
    max_norm_error: float = 0.0
    model_dir: Path | None = None

    @property
    def dest(self) -> Path:
        return self.opts.dest

    @property
    def hidden(self) -> int:
        return self.spec.model.hidden_size

    @property
    def exact_prenorm(self) -> bool:
        """The run holds the last decoder layer's raw output, stored losslessly. An fp8 run's copy of
        it is quantized apart from the final state, so its norm would not give the stored target
        back (it errs by both roundings): there the pre-norm state is derived from the final state,
        like any run without that layer, and the trainer's target is the one the other exports carry."""
        return self.spec.model.num_layers - 1 in self.spec.layers and is_lossless(self.spec.codec)

    def source_id(self, sid: int) -> str:
        value = self.plan.sources.column("source_id")[sid].as_py()
        return value if value else str(sid)

    def prenorm(self, sid: int, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The final state before the norm, [T, H], checked to give back the stored post-norm state."""
        assert self.norm is not None
        post = t["hidden_states"]
        last = self.spec.model.num_layers - 1
        if self.exact_prenorm:
            k = self.spec.layers.index(last)
            pre = t["aux_hidden_states"][:, k * self.hidden : (k + 1) * self.hidden].clone()
        else:
            pre = prenorm_from_post(self.norm, post)
        err = norm_error(self.norm, pre, post)
        limit = tolerance(self.spec.dtype, self.spec.codec)
        if not err <= limit:
            raise ExportRefused(
                f"sample {sid}: the final norm ({self.norm.tensor}, eps {self.norm.eps}) applied to the exported "
                f"pre-norm state differs from the stored post-norm state by {err:.2e} (limit {limit:.0e}); "
                "the model given is not the one that produced the run, or its final norm is not a plain "
                "RMSNorm. Refusing to write wrong targets."
            )
        self.max_norm_error = max(self.max_norm_error, err)
        return pre

    def load_norm(self) -> None:
        self.model_dir = self.model_dir or model_dir_for(self.opts.run, self.spec, self.opts.model)
        try:
            self.norm = load_final_norm(self.model_dir, self.hidden)
        except NormUnavailable as e:
            raise ExportRefused(f"this export needs the pre-norm final state, and {e}") from e
        last = self.spec.model.num_layers - 1
        if self.exact_prenorm:
            self.prenorm_source = f"exact: the run holds hsx layer {last} (the last decoder layer's raw output)"
        else:
            self.prenorm_source = (
                f"post-norm state / {self.norm.tensor} (RMSNorm is scale-invariant: norm(pre) = post to 1 - O(eps), "
                f"eps {self.norm.eps}); each sample checked within {tolerance(self.spec.dtype, self.spec.codec):.0e}"
            )
            if not is_lossless(self.spec.codec):
                self.prenorm_source += (
                    f"; {self.spec.codec} run: norm(pre) is the stored state times a per-token scale within 1/15 of 1"
                )


class TrainerFormat:
    """One trainer's on-disk format. Subclasses write one sample's files, then whatever comes last."""

    name = ""
    description = ""
    needs_prenorm = False
    takes_prenorm = False  # --prenorm changes what it writes (else it is refused as meaningless)

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def check(self) -> None:
        """Refuse before writing anything when the run cannot be expressed in this format."""

    def job(self) -> dict:
        """Options that change the bytes written (part of the export's identity)."""
        return {}

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        raise NotImplementedError

    def finish(self, vocab: tuple[torch.Tensor, torch.Tensor, dict[int, int]] | None) -> list[Written]:
        return []

    def final_state(self) -> str:
        return "post-norm (hsx's stored state)"

    def train_hint(self) -> str:
        """What the trainer must be told that its files cannot say (the run's layers, in its ids)."""
        return ""
