"""A model's decoder layers over pipeline stages: the partition, and one batch through them.

A pipeline of P stages holds contiguous blocks of decoder layers, stage s on ``tensor`` GPUs
(world ranks s*T .. s*T+T-1: a tensor-parallel group per stage). The first stage also holds the
embeddings, the last the final norm and the head. A batch enters the first stage as token ids and
leaves the last as the captured states; between two stages it travels as one tensor per TP rank:
the residual stream after the sender's last layer, with the aux states captured so far beside it
(``Payload``), ``(1 + captured so far) x H`` values a token. The last stage's first rank is the
lead: it writes, so the states end where they are written, and where the final norm and the head
live (a next-token check over the logits belongs there too).

Why point-to-point sends and not ``torch.distributed.pipelining``: its stages exchange tensors of
shapes inferred once, while hsx's batches change shape with every batch (packed rows of the plan's
lengths, or padded rows); every stage needs the batch's positions and sequence bounds, not only the
first; what travels grows along the pipe (the aux states); and a prefill-only job has no backward
for a schedule to order: each stage takes the next batch as soon as it has sent the last one, so
with as many batches in flight as stages every stage stays busy, and the only bubble is the
pipe's filling and draining once per session. The batch's description (sample ids, lengths, token
ids for the first stage) goes over a gloo group on the host; the payload over the default group
(NCCL on CUDA).

Numbers: a stage runs the same modules on the same inputs as one process does (the residual stream
it receives is the sender's tensor, bit for bit), so a pipeline alone changes no bit of the states
(tested on CPU against one process, byte for byte); tensor parallelism within the stages changes
the reduction order as it does without a pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from hsx import fidelity
from hsx.capture import CapturedBatch

Cost = tuple[float, ...]  # (compute, bytes): a token's weights met, and the bytes held on a GPU
Key = TypeVar("Key")  # what a caller tells its batches by, handed back with each capture
# a batch's sequences and fidelity positions (None: unchecked), by its sample ids
Checked = Callable[[list[int]], tuple[list[np.ndarray], list[np.ndarray] | None]]


@dataclass(frozen=True)
class Stages:
    """P contiguous blocks of decoder layers (``ranges``: [first, end) each), each run by ``tensor``
    ranks: stage s on world ranks s * tensor .. (s + 1) * tensor - 1."""

    ranges: tuple[tuple[int, int], ...]
    tensor: int = 1

    @property
    def size(self) -> int:
        return len(self.ranges)

    @property
    def world(self) -> int:
        return self.size * self.tensor

    @property
    def lead(self) -> int:
        """The rank that writes: the last stage's first."""
        return (self.size - 1) * self.tensor

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor

    def owner(self, layer: int) -> int:
        """The stage that runs decoder layer ``layer``."""
        return next(s for s, (first, end) in enumerate(self.ranges) if first <= layer < end)

    def describe(self, stage: int) -> str:
        first, end = self.ranges[stage]
        ends = [" + embeddings"] if stage == 0 else []
        ends += [" + final norm and head"] if stage == self.size - 1 else []
        return f"stage {stage} of {self.size}, layers {first}-{end - 1}{''.join(ends)}"

    def __str__(self) -> str:
        return "; ".join(f"{s}: layers {a}-{b - 1}" for s, (a, b) in enumerate(self.ranges))


def partition(layers: Sequence[Cost], stages: int, first: Cost, last: Cost) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges of ``layers`` (at least one layer each) over ``stages`` stages that keep the
    largest stage's compute (a cost's first figure) as small as can be, and among those, its bytes
    (the second): the slowest stage sets the pipeline's pace, and the fullest its memory. Stage 0
    carries ``first`` too (the embeddings), the last stage ``last`` (the final norm and head)."""
    n = len(layers)
    if not 1 <= stages <= n:
        raise ValueError(f"{stages} pipeline stages need between 1 and {n} (the model's decoder layers)")
    width = len(first)
    prefix = [[0.0] * width]
    for cost in layers:
        prefix.append([a + b for a, b in zip(prefix[-1], cost, strict=True)])

    def stage_cost(s: int, i: int, j: int, k: int) -> float:
        """Figure ``k`` of stage ``s`` holding layers [i, j)."""
        value = prefix[j][k] - prefix[i][k]
        return value + (first[k] if s == 0 else 0.0) + (last[k] if s == stages - 1 else 0.0)

    def best(k: int, cap: float | None) -> tuple[float, list[int]]:
        """The smallest largest figure ``k`` over the partitions whose stages' compute stays within
        ``cap``, and the stage ends that give it (the earliest split where several do)."""
        inf = float("inf")
        value = [[inf] * (n + 1) for _ in range(stages)]
        choice = [[0] * (n + 1) for _ in range(stages)]

        def allowed(s: int, i: int, j: int) -> bool:
            return cap is None or stage_cost(s, i, j, 0) <= cap

        for j in range(1, n + 1):
            if allowed(0, 0, j):
                value[0][j] = stage_cost(0, 0, j, k)
        for s in range(1, stages):
            for j in range(s + 1, n + 1):
                for i in range(s, j):
                    if value[s - 1][i] < inf and allowed(s, i, j):
                        v = max(value[s - 1][i], stage_cost(s, i, j, k))
                        if v < value[s][j]:
                            value[s][j], choice[s][j] = v, i
        ends, j = [n], n
        for s in range(stages - 1, 0, -1):
            j = choice[s][j]
            ends.append(j)
        return value[stages - 1][n], ends[::-1]

    pace, ends = best(0, None)
    if width > 1:
        _, ends = best(1, pace * (1 + 1e-9))
    starts = [0, *ends[:-1]]
    return tuple(zip(starts, ends, strict=True))


# ---------------------------------------------------------------- loading one stage


def stage_groups(stages: Stages) -> list:
    """One torch.distributed group per stage (its tensor-parallel ranks), made by every rank in the
    same order, as ``new_group`` asks: what a stage's split experts sum their outputs over."""
    import torch.distributed as dist

    return [dist.new_group(list(range(s * stages.tensor, (s + 1) * stages.tensor))) for s in range(stages.size)]


@contextlib.contextmanager
def stage_loader(model_class, stages: Stages, rank: int):
    """While open: ``model_class`` as it loads one pipeline stage (yielded), for ``from_pretrained``
    with a ``DistributedConfig`` of ``pp_size`` stages. transformers' own pipeline loading then
    reads only the stage's weights (the embeddings on the first stage, the final norm and head on
    the last) and keeps its tensor-parallel group; its split of the layers is by count, so for the
    load it is ``stages``' split instead. The class built drops what the stage does not run as it
    is constructed (on the meta device, before any weight is placed): transformers 5.25 resolves a
    TP plan over the whole model before its pipeline drops those layers, and then fails on them."""
    from hsx.errors import UnsupportedModel

    try:
        from transformers.distributed import pipeline_parallel as pp
    except ImportError as e:
        raise UnsupportedModel(f"this transformers has no pipeline-parallel loading ({e})") from e
    if model_class is None or not hasattr(pp.PipelineStage, "layer_range_for_rank"):
        what = "this transformers' pipeline loading" if model_class else "a model transformers does not implement"
        raise UnsupportedModel(f"--pipeline-parallel runs transformers' own model classes, and not {what}")
    stage = stages.stage_of(rank)
    first, end = stages.ranges[stage]
    last = stage == stages.size - 1

    def __init__(self, config, *args, **kwargs):
        """The whole model, then None for what the stage does not run (transformers' pipeline puts
        its identity layers there once it has resolved its TP plan over what is left)."""
        model_class.__init__(self, config, *args, **kwargs)
        base = getattr(self, self.base_model_prefix)
        for k in range(len(base.layers)):
            if not first <= k < end:
                base.layers[k] = None
        tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
        if stage > 0 and not (last and tied):
            base.embed_tokens = None
        if not last:
            base.norm = None
            self.lm_head = None

    original = pp.PipelineStage.layer_range_for_rank
    pp.PipelineStage.layer_range_for_rank = lambda self, stage, num_layers: stages.ranges[stage]
    try:
        yield type(model_class.__name__, (model_class,), {"__init__": __init__, "__module__": model_class.__module__})
    finally:
        pp.PipelineStage.layer_range_for_rank = original


# ---------------------------------------------------------------- one batch through the stages


@dataclass
class Batch:
    """What a stage is told of a batch: its samples and their lengths; the first stage also gets
    the token ids. No sample: the end of the session."""

    ids: list[int]
    lengths: list[int]
    tokens: list[np.ndarray] | None = None
    plain: bool = False  # the shadow's recomputation of one sample (``hsx.certify``): the plain path

    @property
    def stop(self) -> bool:
        return not self.ids


STOP = Batch([], [])
AHEAD = 8  # sends a stage may have outstanding (2 or 3 a batch) before it waits for the next stage


class Link:
    """This rank's ends of the pipe: batches' descriptions over ``control`` (a gloo group, on the
    host), their payloads over the default group (NCCL on CUDA), point to point. Every send is
    asynchronous (a blocking one waits for its receiver: the lead handing the first stage its next
    batch while the last-but-one stage hands the lead a batch would wait on each other for ever);
    what was sent is kept until its send completes."""

    def __init__(self, stages: Stages, rank: int, control, device: torch.device):
        self.stages, self.rank, self.control, self.device = stages, rank, control, device
        stage = stages.stage_of(rank)
        self.prev = rank - stages.tensor if stage > 0 else None
        self.next = rank + stages.tensor if stage < stages.size - 1 else None
        self.sending: list = []  # (work, tensor) of the sends not yet known complete, oldest first

    def tell(self, dest: int, batch: Batch) -> None:
        """Send a batch's description (its token ids too, where ``batch.tokens`` holds them)."""
        n = len(batch.ids)
        head = [n, int(batch.tokens is not None), int(batch.plain)]
        self._send(torch.tensor(head, dtype=torch.int64), dest, self.control)
        if n:
            self._send(torch.tensor(batch.ids + batch.lengths, dtype=torch.int64), dest, self.control)
        if n and batch.tokens is not None:
            self._send(torch.from_numpy(np.concatenate(batch.tokens).astype(np.int64)), dest, self.control)

    def hear(self, src: int) -> Batch:
        import torch.distributed as dist

        head = torch.zeros(3, dtype=torch.int64)
        dist.recv(head, src, group=self.control)
        n, has_tokens, plain = (int(v) for v in head)
        if not n:
            return STOP
        body = torch.zeros(2 * n, dtype=torch.int64)
        dist.recv(body, src, group=self.control)
        ids, lengths = body[:n].tolist(), body[n:].tolist()
        tokens = None
        if has_tokens:
            flat = torch.zeros(sum(lengths), dtype=torch.int64)
            dist.recv(flat, src, group=self.control)
            tokens = [t.numpy() for t in torch.split(flat, lengths)]
        return Batch(ids, lengths, tokens, bool(plain))

    def send(self, dest: int, payload: torch.Tensor) -> None:
        self._send(payload.contiguous(), dest, None)

    def receive(self, src: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch.distributed as dist

        payload = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(payload, src)
        return payload

    def _send(self, tensor: torch.Tensor, dest: int, group) -> None:
        import torch.distributed as dist

        self.sending.append((dist.isend(tensor, dest, group=group), tensor))

    def settle(self, most: int | None = None) -> None:
        """Forget the sends that completed; with ``most``, wait until no more are outstanding (a
        stage that runs ahead of the next one waits for it here)."""
        while self.sending and (self.sending[0][0].is_completed() or (most is not None and len(self.sending) > most)):
            self.sending.pop(0)[0].wait()

    def flush(self) -> None:
        self.settle(0)


class StageRunner:
    """One rank's stage: runs a batch through its layers (``backend``: the stage as
    ``TransformersBackend.load`` built it), the residual stream it received fed to its first layer,
    and returns what it hands on: the residual stream after its last layer and every aux state
    captured so far (ascending layer ids), concatenated per token; the last stage returns the aux
    states and the final state."""

    def __init__(self, backend, stages: Stages, rank: int, layers: list[int]):
        self.backend, self.stages = backend, stages
        self.index = stages.stage_of(rank)
        self.first, self.end = stages.ranges[self.index]
        self.is_first, self.is_last = self.index == 0, self.index == stages.size - 1
        self.received = sorted(k for k in layers if k < self.first)  # aux layers in the payload that comes in
        self.here = sorted(k for k in layers if self.first <= k < self.end)
        self.hidden = backend.hidden_size
        self._incoming: torch.Tensor | None = None
        backend.mark_warm()  # compiled: the lead's first batches through the pipe are the canonical ones
        if not self.is_first:
            backend.parts.layers[self.first].register_forward_pre_hook(self._feed, with_kwargs=True)
        if not self.is_last:
            backend.keep_output(self.end - 1)

    def _feed(self, _module, args, kwargs):
        """The first layer's input is the residual stream received, as it was sent: whatever the
        base model did to its ``inputs_embeds`` on the way (some scale them) is not applied twice."""
        if args:
            return (self._incoming, *args[1:]), kwargs
        return args, kwargs | {"hidden_states": self._incoming}

    def payload_shape(self, batch: Batch) -> tuple[int, ...]:
        """The incoming payload's shape: the batch laid out as the backend lays it (one packed row,
        or padded rows), ``(1 + aux received) x H`` a token."""
        rows, width = (1, sum(batch.lengths)) if self.backend.packed else (len(batch.lengths), max(batch.lengths))
        return rows, width, self.hidden * (1 + len(self.received))

    def rows(self, lengths: list[int]) -> tuple[list[int], list[int]]:
        """Each sample's row and offset in the batch as the backend lays it out (packed or padded)."""
        if self.backend.packed:
            return [0] * len(lengths), np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
        return list(range(len(lengths))), [0] * len(lengths)

    @torch.inference_mode()
    def figures(
        self, lengths: list[int], final: torch.Tensor, sequences: Sequence[np.ndarray], checks: Sequence[np.ndarray]
    ) -> torch.Tensor:
        """The last stage's fidelity check of a batch (``hsx.fidelity``): its own final norm and head."""
        rows, offsets = self.rows(lengths)
        b = self.backend
        return fidelity.measure(b.head, final, rows, offsets, sequences, checks, normed=not b.prenorm)

    @torch.inference_mode()
    def run(self, batch: Batch, incoming: torch.Tensor | None) -> torch.Tensor | tuple[dict, torch.Tensor]:
        """The batch through this stage; a plain batch (the shadow's) through the plain path."""
        if not batch.plain:
            return self._run(batch, incoming)
        with self.backend.plain_mode():
            return self._run(batch, incoming)

    def _run(self, batch: Batch, incoming: torch.Tensor | None) -> torch.Tensor | tuple[dict, torch.Tensor]:
        b = self.backend
        sequences = batch.tokens or [np.zeros(n, dtype=np.int64) for n in batch.lengths]
        inputs = b.inputs(sequences)
        received: list[torch.Tensor] = []
        if incoming is not None:
            self._incoming, *received = torch.split(incoming, self.hidden, dim=-1)
            inputs.pop("input_ids")
            inputs["inputs_embeds"] = self._incoming
        b.forward(inputs)
        self._incoming = None
        if self.is_last:
            *here, final = b.take([*self.here, "final"])
            return dict(zip(self.received + self.here, received + here, strict=True)), final
        out, *here = b.take([self.end - 1, *self.here])
        return torch.cat([out, *received, *here], dim=-1)


def follow(runner: StageRunner, link: Link, lead: int, checked: Checked | None = None) -> None:
    """A rank that does not write: each batch from the rank before it (the first stage's from the
    lead) through its stage and on to the rank after it, until told to stop; the stop goes on.
    ``checked``: on the last stage's other ranks, each batch's sequences and fidelity positions by
    its ids (the plan's), for the check the lead's head computes with them (a sharded head gathers)."""
    source = lead if runner.is_first else link.prev
    while True:
        batch = link.hear(source)
        if batch.stop:
            if link.next is not None:
                link.tell(link.next, STOP)
            link.flush()
            return
        incoming = None
        if not runner.is_first:
            incoming = link.receive(link.prev, runner.payload_shape(batch), runner.backend.dtype)
        out = runner.run(batch, incoming)
        if checked is not None and runner.is_last and not batch.plain:
            sequences, checks = checked(batch.ids)
            if checks is not None:
                runner.figures(batch.lengths, out[1], sequences, checks)
        if link.next is not None:
            link.tell(link.next, Batch(batch.ids, batch.lengths, plain=batch.plain))
            link.send(link.next, out)
            link.settle(AHEAD)


class PipelineCapture:
    """The lead's capture over a pipeline (the ``Capture`` contract, and ``stream`` for batches in
    flight): it hands each batch's token ids to the first stage's ranks, then takes the batch from
    the stage before its own, runs its own stage and assembles the states in the run's layer order.
    ``depth``: batches in the pipe at once (as many as stages keeps each busy; one more lets the
    first stage start the next while the lead takes the last)."""

    def __init__(self, runner: StageRunner, link: Link, layers: list[int], depth: int | None = None):
        self.runner, self.link, self.layers = runner, link, list(layers)
        self.device, self.dtype = runner.backend.device, runner.backend.dtype
        self.depth = depth or runner.stages.size + 1
        self.pending: list[Batch] = []
        self.cold = runner.backend.compiled

    def warm_up(self) -> None:
        """Compiled layers: the canonical batches first (``TransformersBackend._warm_up``), through
        the pipe, so that every stage traces its layers on the batches one process would."""
        self.cold = False
        batches = self.runner.backend.warm_up_batches()
        for _ in self.stream((None, list(range(-len(b), 0)), b, None) for b in batches):
            pass

    def submit(
        self, sample_ids: list[int], sequences: list[np.ndarray], checks: list[np.ndarray] | None = None
    ) -> None:
        if self.cold:
            self.warm_up()
        batch = Batch(list(sample_ids), [len(s) for s in sequences], list(sequences))
        # the samples the shadow recomputes follow their batch down the pipe, one by one
        rows = self.runner.backend.shadow_rows(list(sample_ids))
        plain = [Batch([sample_ids[i]], [len(sequences[i])], [sequences[i]], plain=True) for i in rows]
        for b in (batch, *plain):
            for rank in range(self.runner.stages.tensor):  # the first stage's ranks
                self.link.tell(rank, b)
        self.link.settle()  # never waits: the first stage takes a batch once it is done with the last
        self.pending.append((Batch(batch.ids, batch.lengths), batch.tokens, checks, plain))

    def collect(self) -> CapturedBatch:
        """The oldest batch submitted, captured (with its fidelity figures where it was checked)."""
        want, sequences, checks, plain = self.pending.pop(0)
        aux, final = self._take(want)
        rows, offsets = self.runner.rows(want.lengths)
        states = torch.cat([aux[k] for k in self.layers], dim=-1) if self.layers else final[..., :0]
        captured = CapturedBatch(want.ids, want.lengths, states, final, rows, offsets)
        if checks is not None:
            captured.fidelity = self.runner.figures(want.lengths, final, sequences, checks)
        recomputed = {}
        for p in plain:  # the plain path's states, as one process's ``TransformersBackend.plain`` gives them
            p_aux, p_final = self._take(p)
            recomputed[want.ids.index(p.ids[0])] = [p_aux[k][0] for k in self.layers] + [p_final[0]]
        if self.runner.backend.checks is not None:
            captured.taps = self.runner.backend.tap_checks(captured, recomputed)
        return captured

    def _take(self, want: Batch) -> tuple[dict, torch.Tensor]:
        """The next batch from the stage before, through the lead's own stage: (aux states by layer, final)."""
        batch = self.link.hear(self.link.prev)
        if batch.ids != want.ids or batch.plain != want.plain:
            raise RuntimeError(f"the pipe handed on samples {batch.ids[:4]}... for {want.ids[:4]}...")
        incoming = self.link.receive(self.link.prev, self.runner.payload_shape(batch), self.dtype)
        return self.runner.run(batch, incoming)

    def capture(
        self, sample_ids: list[int], sequences: list[np.ndarray], checks: list[np.ndarray] | None = None
    ) -> CapturedBatch:
        self.submit(sample_ids, sequences, checks)
        while len(self.pending) > 1:
            self.collect()  # an earlier batch nobody took: not what ``capture`` is for
        return self.collect()

    def stream(
        self, batches: Iterable[tuple[object, list[int], list[np.ndarray], list[np.ndarray] | None]]
    ) -> Iterator[tuple[object, CapturedBatch]]:
        """Each batch's capture, in order, with up to ``depth`` batches in the pipe: (key, ids,
        sequences, fidelity positions or None) in, (key, its capture) out."""
        keys: list[Key] = []
        for key, ids, sequences, checks in batches:
            self.submit(ids, sequences, checks)
            keys.append(key)
            if len(self.pending) >= self.depth:
                yield keys.pop(0), self.collect()
        while self.pending:
            yield keys.pop(0), self.collect()

    def close(self) -> None:
        """End the session: the batches still in the pipe are taken (the stages send them whatever
        happens) and dropped, then every rank is told to stop."""
        while self.pending:
            self.collect()
        for rank in range(self.runner.stages.tensor):
            self.link.tell(rank, STOP)
        if not self.link.hear(self.link.prev).stop:
            raise RuntimeError("the pipe handed on a batch after its end")
        self.link.flush()
