"""The target's own next-token distribution, stored beside its states (``hsx extract --teacher``).

Drafts trained against the target's distribution (KL, total variation, ListMLE over its top-k) need
it at every loss-masked position; recomputing it in the trainer means loading the target's LM head
on every rank and getting the final norm's side right. hsx computes it where it already has both:
on the device, right after the forward, through the same ``fidelity.Head`` the fidelity check uses
(its final norm for a pre-norm state, its LM head in the run's dtype), and stores it in the sample
file under the digest (``store.format``: the tensors and their rows).

- ``topk:K``: the K largest log-probabilities (log-softmax in float32 over the full vocabulary,
  stored in the run's dtype) and their token ids.
- ``draft-vocab:FILE``: the softmax over the logits of the draft vocabulary's ids alone (what
  NeMo-Automodel's EAGLE-3 ``target_probs`` is), and the full vocabulary's argmax. FILE is a
  ``hsx vocab`` map: ``d2t-D.npy`` (offsets) or ``t2d-D.npy`` (a mask over the target vocabulary);
  the run keeps its ids (``layout.TEACHER_VOCAB``), so a resume needs nothing outside the run.

The choice is in the spec (``spec.TeacherSpec``): a resume asking for another is refused by name.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hsx.errors import OptionError, SpecError
from hsx.fidelity import Head, flat_rows, to_device
from hsx.spec import TeacherSpec
from hsx.store import layout
from hsx.store.durable import write_durable
from hsx.store.format import digest

if TYPE_CHECKING:
    import torch

    from hsx.plan import Plan

KINDS = ("topk", "draft-vocab")
HELP = "topk:K (the K most likely ids and log-probabilities) or draft-vocab:FILE (an hsx vocab d2t/t2d .npy)"


@dataclass(frozen=True)
class Asked:
    """``--teacher`` as given: ``topk`` with ``k``, or ``draft-vocab`` with the vocabulary's ids."""

    kind: str
    k: int = 0
    vocab: np.ndarray | None = None  # the draft vocabulary's target ids, increasing (draft-vocab)

    def spec(self, masked_share: float = 1.0) -> TeacherSpec:
        if self.vocab is None:
            return TeacherSpec(kind="topk", k=self.k, masked_share=masked_share)
        return TeacherSpec(
            kind="draft-vocab",
            vocab_size=len(self.vocab),
            vocab_digest=digest(vocab_bytes(self.vocab)),
            masked_share=masked_share,
        )


def parse(value: str) -> Asked:
    """``--teacher``'s value; ``OptionError`` naming what is wrong."""
    kind, _, arg = value.partition(":")
    if kind not in KINDS or not arg:
        raise OptionError(f"--teacher {value}: give {HELP}")
    if kind == "topk":
        try:
            k = int(arg)
        except ValueError:
            k = 0
        if k < 1:
            raise OptionError(f"--teacher {value}: K is a positive number of token ids")
        return Asked("topk", k=k)
    return Asked("draft-vocab", vocab=read_map(Path(arg)))


def planned(value: str) -> TeacherSpec:
    """``hsx memory --teacher``: what a run would store, ``draft-vocab`` also given as its size alone."""
    kind, _, arg = value.partition(":")
    if kind == "draft-vocab" and arg.isdigit() and int(arg) > 0:
        return TeacherSpec(kind="draft-vocab", vocab_size=int(arg))
    return parse(value).spec()


def read_map(path: Path) -> np.ndarray:
    """The target ids of an ``hsx vocab`` map (``d2t-D.npy``: target id = draft id + d2t[draft id];
    ``t2d-D.npy``: a mask over the target vocabulary), read without pickle."""
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise OptionError(f"--teacher draft-vocab:{path}: not a readable .npy file ({e})") from e
    if arr.ndim != 1 or not len(arr):
        raise OptionError(f"--teacher draft-vocab:{path}: a vocab map is one non-empty row, not shape {arr.shape}")
    if arr.dtype == np.bool_:
        ids = np.flatnonzero(arr)
    elif np.issubdtype(arr.dtype, np.integer):
        ids = np.arange(len(arr)) + arr.astype(np.int64)
    else:
        raise OptionError(f"--teacher draft-vocab:{path}: {arr.dtype} is neither d2t (integers) nor t2d (bools)")
    ids = ids.astype(np.int64)
    if not len(ids) or ids[0] < 0 or (len(ids) > 1 and bool((np.diff(ids) <= 0).any())):
        raise OptionError(f"--teacher draft-vocab:{path}: its target ids are not distinct, increasing and >= 0")
    return ids


def check_vocab(asked: Asked, vocab: int) -> None:
    """Refuse a choice the target's vocabulary cannot give."""
    if asked.vocab is None and asked.k > vocab:
        raise OptionError(f"--teacher topk:{asked.k}: the target's vocabulary has {vocab} ids")
    if asked.vocab is not None and int(asked.vocab[-1]) >= vocab:
        raise OptionError(
            f"--teacher draft-vocab: the map holds target id {int(asked.vocab[-1])}, outside the target's "
            f"vocabulary of {vocab}"
        )


def vocab_bytes(ids: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, ids.astype(np.int64), allow_pickle=False)
    return buf.getvalue()


def write_vocab(run: Path, asked: Asked) -> None:
    """A new draft-vocab run keeps its vocabulary (before its spec, which records the digest)."""
    if asked.vocab is not None:
        write_durable(run / layout.TEACHER_VOCAB, vocab_bytes(asked.vocab))


def masked_positions(mask: np.ndarray) -> np.ndarray:
    """The positions a sample's teacher rows are for: those whose loss mask is set, in order."""
    return np.flatnonzero(np.asarray(mask))


@dataclass
class Rows:
    """A batch's teacher rows: each ``store.format.TEACHER`` tensor over every sample's rows,
    concatenated in the batch's order (``counts[i]`` rows of sample i)."""

    tensors: dict[str, torch.Tensor]
    counts: list[int]

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        lo = sum(self.counts[:i])
        return {k: t[lo : lo + self.counts[i]] for k, t in self.tensors.items()}


class Teacher:
    """A run's teacher: what it stores (``spec``) and, for a draft-vocab run, the vocabulary's ids."""

    def __init__(self, spec: TeacherSpec, vocab: np.ndarray | None = None):
        self.spec = spec
        self.vocab = vocab
        self._on: dict[str, torch.Tensor] = {}  # the vocabulary's ids, by device

    @classmethod
    def of_run(cls, run: Path, spec: TeacherSpec | None) -> Teacher | None:
        """The run's teacher (None: it stores none); a draft vocabulary read from the run and held to
        the spec's digest."""
        if spec is None:
            return None
        if spec.kind == "topk":
            return cls(spec)
        path = run / layout.TEACHER_VOCAB
        try:
            raw = path.read_bytes()
        except FileNotFoundError as e:
            raise SpecError(f"{path} is missing: the run's teacher needs its draft vocabulary") from e
        if digest(raw) != spec.vocab_digest:
            raise SpecError(f"{path} is damaged: its digest is not the one the run spec records")
        return cls(spec, np.load(io.BytesIO(raw), allow_pickle=False))

    @property
    def info(self) -> str:
        """The sample file's ``teacher`` metadata: what its teacher tensors are."""
        return self.spec.label()

    def work(self, plan: Plan, ids: Sequence[int]) -> Work:
        """What a batch of the plan's samples ``ids`` asks of the capture (every rank computing the
        batch asks the same)."""
        return Work(self, [masked_positions(plan.loss_mask(i)) for i in ids])

    def rows(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored rows of these logits [n, vocab] (in the head's dtype): ``store.format.TEACHER``."""
        import torch

        dtype = logits.dtype
        if self.vocab is None:  # the top-k of the logits are those of the log-softmax: no [n, vocab] result kept
            top, ids = logits.topk(self.spec.k, dim=-1)
            values = top.float() - logits.float().logsumexp(-1, keepdim=True)
            return {"teacher_ids": ids.to(torch.int32), "teacher_logprobs": values.to(dtype)}
        device = str(logits.device)
        if device not in self._on:
            self._on[device] = torch.from_numpy(self.vocab).to(logits.device)
        probs = logits.index_select(-1, self._on[device]).float().softmax(-1)
        return {"teacher_argmax": logits.argmax(-1).to(torch.int32), "teacher_probs": probs.to(dtype)}


@dataclass
class Work:
    """A batch's teacher work, handed to the capture with the batch: the run's teacher and each
    sample's masked positions."""

    teacher: Teacher
    positions: list[np.ndarray]

    def compute(self, head: Head, final: torch.Tensor, rows: list[int], offsets: list[int], normed: bool) -> Rows:
        """The batch's rows, on the device: sample i's states are ``final[rows[i], offsets[i] + t]``,
        its rows at ``positions[i]``. ``normed``: the states are after the final norm (as
        ``fidelity.measure`` takes them)."""
        import torch

        at = to_device(flat_rows(rows, offsets, final.shape[1], self.positions), final.device)
        parts: dict[str, list[torch.Tensor]] = {}
        for _, logits in head.logits(final, at, normed):
            for name, t in self.teacher.rows(logits).items():
                parts.setdefault(name, []).append(t)
        if not parts:  # no masked position in the batch: empty rows of the right shapes
            parts = {k: [v] for k, v in self.teacher.rows(final.new_zeros((0, head.vocab))).items()}
        return Rows({k: torch.cat(v) for k, v in parts.items()}, [len(p) for p in self.positions])


def work_for(teacher: Teacher | None, plan: Plan, ids: Sequence[int]) -> Work | None:
    """A batch's teacher work (None: the run stores no teacher)."""
    return None if teacher is None else teacher.work(plan, ids)


def spread(rows: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """A sample's rows [M, ...] placed at its masked positions of [T, ...] (zeros elsewhere): what a
    trainer that indexes by position reads."""
    out = rows.new_zeros((loss_mask.shape[0], *rows.shape[1:]))
    out[loss_mask.bool()] = rows
    return out
