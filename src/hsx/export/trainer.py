"""What a trainer format is, and what it writes with: the export's options, its context (run,
plan, final norm), and durable files recorded with their size and digest.

Each trainer module subclasses ``TrainerFormat``; ``core`` drives them through a run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from hsx import certify
from hsx.bounds import EXPORT
from hsx.drafts import EAGLE3, EAGLE_TAPS, MTP, eagle3_taps
from hsx.errors import ExportRefused, NormUnavailable, OptionError
from hsx.export.norm import diagnose, load_final_norm, norm_error, prenorm_from_post, tolerance
from hsx.finalnorm import FinalNorm
from hsx.plan import Plan
from hsx.spec import RunSpec, model_location
from hsx.store import layout
from hsx.store.codec import is_lossless
from hsx.store.durable import write_durable
from hsx.store.format import FinalStateNorm, digest
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
    draft: str = EAGLE3  # the draft type trained (hsx.export.core.DRAFTS: which trainer takes which)
    taps: list[int] | None = None  # the run's taps to export, hsx ids (default: the draft type's, see Context.taps)

    def __post_init__(self) -> None:
        """Refuse a value out of its bound, or one that would be ignored, before anything is read."""
        EXPORT.check(self)
        if self.target_vocab is not None and self.draft_vocab is None:
            raise OptionError("--target-vocab sizes the draft-vocab map of --draft-vocab, which is not given")

    def command(self) -> str:
        """This export as a command line that works from any directory (it continues a stopped one)."""
        args = ["hsx", "export", self.run.absolute(), self.dest.absolute(), "--to", self.to]
        args += ["--draft", self.draft] if self.draft != EAGLE3 else []
        args += ["--taps", ",".join(map(str, self.taps))] if self.taps is not None else []
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


def export_taps(spec: RunSpec, draft: str, asked: list[int] | None) -> list[int]:
    """The run's taps a draft type is exported with, hsx ids: those asked (each one the run's), none
    for MTP, EAGLE-3's three for it and P-EAGLE (the run's nearest to its defaults where the run has
    more), or every tap of the run for the DFlash family (one per draft layer). Refused where the run
    cannot feed it."""
    have = list(spec.layers)
    if asked is not None:
        missing = [k for k in asked if k not in have]
        if missing or len(set(asked)) != len(asked):
            raise ExportRefused(f"--taps {asked}: the run holds taps {have} (hsx ids); name each of them once")
        if (draft == MTP) != (not asked):
            raise ExportRefused(
                f"an MTP draft reads the final state alone, any other type taps: --taps {asked} with {draft}"
            )
        return list(asked)
    if draft == MTP:
        return []
    if not have:
        raise ExportRefused(
            f"a {draft} draft reads taps, and this run has none (it was made with --layers mtp: the final state "
            "alone); extract with --layers eagle3 or dflash:N"
        )
    if draft not in EAGLE_TAPS:
        return have
    if len(have) < 3:
        raise ExportRefused(f"an EAGLE-3-style ({draft}) draft reads 3 taps; this run has {len(have)} ({have})")
    if len(have) == 3:
        return have
    picked: list[int] = []
    for want in eagle3_taps(spec.model.num_layers):
        picked.append(min((k for k in have if k not in picked), key=lambda k: (abs(k - want), k)))
    return sorted(picked)


# What a pre-norm state derived from a post-norm run holds: its length is estimated from the
# mean-square deficit, which on most models is a few float32 roundings (docs/exports.md).
DIRECTION_ONLY = (
    "its direction exact, its length an estimate (off by percents or more where the final states' mean "
    "square is far above the norm's eps, as in most models)"
)
PRENORM_ADVICE = (
    "a trainer that applies the final norm itself (speculators, Model-Optimizer --prenorm) gets its target "
    "exactly; for the true pre-norm state, extract with --final-state pre"
)


@dataclass
class Context:
    """Everything a trainer format needs while writing: the run, its plan, the taps exported, the final norm."""

    opts: ExportOptions
    spec: RunSpec
    plan: Plan
    ids: list[int]  # sample id of each export index
    taps: list[int] = field(default_factory=list)  # the taps exported, hsx ids, in the run's order or as asked
    norm: FinalNorm | None = None
    conversion: str = ""  # how the final state is turned into the other norm's, for the manifest
    derived: str = ""  # what of the exported final state is exact where it is derived from the run's other side
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
        """The run holds the last decoder layer's raw output as a tap, stored losslessly (runs made
        before the final state could be stored pre-norm captured it so). An fp8 run's copy of it is
        quantized apart from the final state, so its norm would not give the stored target back (it
        errs by both roundings): there the pre-norm state is derived from the final state, like any
        run without that layer, and the trainer's target is the one the other exports carry."""
        return self.spec.model.num_layers - 1 in self.spec.layers and is_lossless(self.spec.codec)

    def model(self) -> Path:
        """The run's model folder (checked against its fingerprint), which training commands name."""
        self.model_dir = self.model_dir or model_dir_for(self.opts.run, self.spec, self.opts.model)
        return self.model_dir

    def certificate_note(self) -> dict | None:
        """The run's certificate in a trainer's own metadata, where it has a place: its verdict and
        the digest of ``certificate.json`` (``hsx-export.json`` beside it holds the whole of it);
        None for a run made before certificates."""
        cert = certify.read_certificate(self.opts.run)
        if cert is None:
            return None
        raw = (self.opts.run / layout.CERTIFICATE).read_bytes()
        return {"verdict": cert.verdict, "certificate_digest": digest(raw), "hsx_version": cert.hsx_version}

    def model_named(self) -> str:
        """The model a training command names: the folder checked, where the export read it, else
        the one given or where the run looks (an export that reads no weight never fails on it)."""
        if self.model_dir is not None:
            return str(self.model_dir)
        return location(self.opts.model) if self.opts.model is not None else model_location(self.opts.run, self.spec)

    def refuse_unsorted_taps(self, trainer: str, strictly: bool = False) -> None:
        """Refuse taps a trainer's reader takes only in ascending order (``strictly``: without repeats)."""
        taps, order = self.taps, sorted(set(self.taps) if strictly else self.taps)
        if taps != order:
            raise ExportRefused(
                f"{trainer} takes target_layer_ids {'strictly increasing' if strictly else 'in ascending order'}; "
                + (f"--taps {taps} are not" if self.opts.taps is not None else f"the run's taps {taps} are not")
                + f": export with --taps {','.join(map(str, order))}"
            )

    def refuse_draft_vocab(self, drafts: str) -> None:
        """Refuse a draft-vocab map for drafts that predict over the target's whole vocabulary."""
        if self.opts.draft_vocab is not None:
            raise ExportRefused(
                f"{drafts} predict over the target's vocabulary and read no draft-vocab map: drop --draft-vocab"
            )

    def source_id(self, sid: int) -> str:
        value = self.plan.sources.column("source_id")[sid].as_py()
        return value if value else str(sid)

    def aux(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The exported taps' states of a sample, [T, len(taps)*H], in ``taps``' order."""
        T, H = t["hidden_states"].shape
        if not self.taps:  # before the next test: a run with no taps (--layers mtp) stores none
            return t["hidden_states"].new_empty(T, 0)
        if self.taps == self.spec.layers:
            return t["aux_hidden_states"]
        rows = [self.spec.layers.index(k) for k in self.taps]
        return t["aux_hidden_states"].view(T, -1, H)[:, rows].reshape(T, -1)

    def final(self, sid: int, t: dict[str, torch.Tensor], side: FinalStateNorm) -> torch.Tensor:
        """The final state after the norm or before it, [T, H]: as stored, or converted (checked)."""
        if side == self.spec.final_norm:
            return t["hidden_states"]
        if side == "post":  # from the stored pre-norm state: the norm as transformers computes it
            assert self.norm is not None
            return self.norm.apply(t["hidden_states"])
        return self.prenorm(sid, t)

    def prenorm(self, sid: int, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The final state before the norm, [T, H], from a post-norm run, checked to give back the
        stored post-norm state."""
        assert self.norm is not None
        post = t["hidden_states"]
        last = self.spec.model.num_layers - 1
        if self.exact_prenorm:
            k = self.spec.layers.index(last)
            pre = t["aux_hidden_states"][:, k * self.hidden : (k + 1) * self.hidden].clone()
        else:
            pre = prenorm_from_post(self.norm, post, is_lossless(self.spec.codec))
        err = norm_error(self.norm, pre, post)
        limit = tolerance(self.spec.dtype, self.spec.codec)
        if not err <= limit:
            raise ExportRefused(
                f"sample {sid}: the final norm of the exported pre-norm state does not give back the stored "
                "post-norm state; refusing to write wrong targets. "
                + diagnose(self.norm, pre, post, limit, str(self.model_dir))
            )
        self.max_norm_error = max(self.max_norm_error, err)
        return pre

    def load_norm(self, side: FinalStateNorm) -> None:
        """Read the final norm where the export's final state is on its other side than the run's."""
        if side == self.spec.final_norm:
            return
        try:
            self.norm = load_final_norm(self.model(), self.hidden)
        except NormUnavailable as e:
            raise ExportRefused(f"this export needs the final state {side}-norm, and {e}") from e
        self.derived = "exact"
        if side == "post":
            self.conversion = f"the stored pre-norm state through {self.norm.tensor} (eps {self.norm.eps}): exact"
            return
        last = self.spec.model.num_layers - 1
        if self.exact_prenorm:
            self.conversion = f"exact: the run holds hsx layer {last} (the last decoder layer's raw output)"
            return
        self.derived = DIRECTION_ONLY
        self.conversion = (
            f"DERIVED from the post-norm state / {self.norm.tensor} (eps {self.norm.eps}): {DIRECTION_ONLY}; "
            "norm(pre) = post to rounding, each sample checked within "
            f"{tolerance(self.spec.dtype, self.spec.codec):.0e}"
        )
        if not is_lossless(self.spec.codec):
            self.conversion += (
                f"; {self.spec.codec} run: norm(pre) is the stored state times a per-token scale within 1/15 of 1"
            )


class TrainerFormat:
    """One trainer's on-disk format. Subclasses write one sample's files, then whatever comes last."""

    name = ""
    description = ""
    drafts: tuple[str, ...] = (EAGLE3,)  # the draft types its trainer trains from such files
    untaken: ClassVar[dict[str, str]] = {}  # why its trainer takes no files for a draft type it trains otherwise
    takes_prenorm = False  # --prenorm changes what it writes (else it is refused as meaningless)
    reads: FinalStateNorm = "post"  # the final state's norm its trainer reads (without --prenorm)
    # why its files carry no --teacher distribution: where in its data the trainer could read one
    no_teacher = "its trainer reads no target distribution from its data"

    def __init__(self, ctx: Context):
        self.ctx = ctx

    @classmethod
    def build(cls, ctx: Context) -> TrainerFormat:
        """The format that writes ``ctx``'s draft type (a trainer with one cache per type picks it)."""
        return cls(ctx)

    @property
    def draft(self) -> str:
        return self.ctx.opts.draft

    def check(self) -> None:
        """Refuse before writing anything when the run cannot be expressed in this format."""

    def side(self) -> FinalStateNorm:
        """The final state's norm this export writes."""
        return self.reads

    def holds_final(self) -> bool:
        """Whether its files hold the final state (else neither the norm nor the model is read for it)."""
        return True

    def job(self) -> dict:
        """Options that change the bytes written (part of the export's identity)."""
        return {}

    def refuse(self, sid: int) -> str | None:
        """Why the trainer cannot take sample ``sid`` (read from the plan, no state), or None."""
        return None

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        raise NotImplementedError

    def finish(self, vocab: tuple[torch.Tensor, torch.Tensor, dict[int, int]] | None) -> list[Written]:
        return []

    def final_state(self) -> str:
        """The final state written, in words: its norm, and how it was obtained from the run's."""
        side = "post-norm" if self.side() == "post" else "pre-norm"
        return f"{side} ({self.ctx.conversion or 'as the run stores it'})"

    def train_hint(self) -> str:
        """What the trainer must be told that its files cannot say (the run's layers, in its ids)."""
        return ""

    def teacher_note(self) -> str:
        """What the export does with a ``--teacher`` run's distribution, in words ("" for a run without)."""
        stored = self.ctx.spec.teacher
        return "" if stored is None else f"the run's {stored} is not exported: {self.no_teacher}"
