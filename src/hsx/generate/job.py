"""``hsx generate``: the job that keeps the engine full and writes each conversation once it is whole.

    hsx generate --model M --data IN --out GEN     new run: plan, engine, spec, then generation
    hsx generate --out GEN                          resume: everything comes from GEN/hsx.json

Under the run's lock, the job runs the prologue every job runs (``job.prologue``: stray temp files
removed, headers then digests verified, damaged files redone, complete shards sealed, the space the
rest needs projected), and then feeds the engine: up to ``engine.max_pending``
requests are in flight, one per conversation, whose next turn is submitted when its previous one
came back (its prompt holds that answer). A conversation whose last turn is done is handed to the store's
writer threads (``store.writer.SampleWriter``: temp, fsync, rename; the folder fsynced before it
counts), so the engine is fed again at once rather than idling while a batch that finished in the
same step is written file by file. It counts as done, and its shard is sealed after its last file,
only once the file is durable; so "done" is a verified file per conversation id, exactly once,
whatever order the engine answers in, and a kill loses only the conversations in flight or being
written, which a resume redoes from their first turn with the same seeds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np
import xxhash

from hsx import target
from hsx.errors import BadFile, CaptureFailed, DiskFull
from hsx.generate import toolcalls
from hsx.generate.dialogue import Dialogue
from hsx.generate.engine import Completion, Engine, Request, Sampling
from hsx.generate.engines import EngineSettings, open_engine
from hsx.generate.folder import PLAN_REJECTS, check_engine, create_spec, open_gen_run, plan_run
from hsx.generate.options import GenerateOptions
from hsx.generate.plan import GenPlan, load_gen_plan, too_long
from hsx.generate.progress import GenProgress
from hsx.generate.prompts import Prompter, stop_ids
from hsx.generate.record import ConversationRecord, GeneratedTurn, Source, encode_record, read_record, statuses
from hsx.generate.spec import BYTES_PER_TOKEN, GenerateSpec
from hsx.input import Reject
from hsx.input import Source as InputSource
from hsx.job.folder import record_failed_start
from hsx.job.prologue import Prologue, locked
from hsx.job.space import DiskGuard
from hsx.plan import Tokenize
from hsx.store import layout
from hsx.store.durable import write_durable
from hsx.store.scan import ShardScan
from hsx.store.writer import FileRecord, SampleWriter, seal

LARGE = 2e9  # parameters above which the transformers engine is said not to be the production route
WRITERS = 8  # writer threads: a batch finishing in one engine step is written in parallel, off the engine's path
WRITE_AHEAD = 256 << 20  # bytes of finished conversations queued for the writers at most (then the engine waits)


@dataclass
class GenerateSummary:
    """What a generate session did, and where the run stands."""

    run: object
    total: int
    already_done: int = 0
    written: int = 0
    rejected_now: int = 0  # conversations this session rejected (prompt over the limit, engine failure)
    ended_now: int = 0  # conversations this session kept up to where they ended (a prompt too long, a call unpaired)
    turns: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    redone: dict[str, int] = field(default_factory=dict)

    @property
    def done(self) -> int:
        return self.already_done + self.written

    @property
    def total_samples(self) -> int:  # the name a clean stop's message reads (as an extraction's summary)
        return self.total

    @property
    def complete(self) -> bool:
        return self.done == self.total

    def lines(self) -> list[str]:
        rate = f" ({self.new_tokens / self.seconds:,.0f} new tokens/s)" if self.seconds > 0 and self.new_tokens else ""
        out = [
            f"run        {self.run}  ({'complete' if self.complete else 'incomplete'})",
            f"convs      {self.done}/{self.total} done, {self.written} written now "
            f"({self.rejected_now} of them rejected, {self.ended_now} ended early), "
            f"{self.already_done} were already verified",
            f"generated  {self.turns} turns, {self.new_tokens:,} new tokens in {self.seconds:.1f}s{rate}",
        ]
        if self.redone:
            out.append("redone     " + ", ".join(f"{n} {k}" for k, n in sorted(self.redone.items())))
        return out


def request_seed(seed: int, key: str, turn: int) -> int:
    """A request's seed: a function of the run's seed, the conversation key and the turn only."""
    return xxhash.xxh3_64_intdigest(f"{seed}/{key}/{turn}".encode()) & (2**63 - 1)


class ConversationLoop:
    """Keeps ``engine`` full with the turns of the missing conversations; writes each one whole."""

    def __init__(
        self,
        spec: GenerateSpec,
        run,
        plan: GenPlan,
        engine: Engine,
        prompter: Prompter,
        progress: GenProgress,
        reserve: int,
        summary: GenerateSummary,
    ):
        self.spec, self.run, self.plan, self.engine, self.prompter = spec, run, plan, engine, prompter
        self.progress, self.summary = progress, summary
        self.sampling = spec.sampling.sampling()
        self.active: dict[str, tuple[Dialogue, np.ndarray]] = {}  # request key -> (dialogue, its prompt)
        self.shards: dict[int, dict[int, FileRecord]] = {}
        self.left: dict[int, int] = {}
        self.writer = SampleWriter(run, spec.shard_size, [], threads=WRITERS, max_inflight_bytes=WRITE_AHEAD)
        self.writer.start_threads()
        self.writing: dict[Future, tuple[Dialogue, str | None]] = {}  # files being written -> (conversation, reject)
        # bytes queued for the writers count as spent
        self.guard = DiskGuard(run, reserve, lambda: self.writer.inflight)

    def run_shards(self, todo: list[ShardScan]) -> None:
        queue: list[int] = []
        for scan in todo:
            self.shards[scan.shard] = dict(scan.good)
            self.left[scan.shard] = len(scan.missing)
            queue += scan.missing
        queue.reverse()
        try:
            with self.progress.live("generating"):
                while queue or self.active:
                    while queue and len(self.active) < max(self.engine.max_pending, 1):
                        self.start(queue.pop())
                    for outcome in self.engine.poll(None if self.active else 0):
                        self.outcome(outcome)
                    self.collect(wait=False)
                self.collect(wait=True)
        except DiskFull:  # the files written whole before the stop count (their shards are sealed on resume)
            self.writer.close()
            whole = [f for f in self.writing if f.exception() is None]
            self.writer.sync()
            self.count(whole, [f.result() for f in whole], seal_shards=False)
            raise
        finally:
            self.writer.close()  # queued writes finish (or fail and remove their temp files)

    def start(self, cid: int) -> None:
        row = self.plan.row(cid)
        self.advance(Dialogue(cid, row.messages, row.targets, row.tools))

    def advance(self, d: Dialogue) -> None:
        """Submit ``d``'s next turn, or write it when it has none left (or cannot go on)."""
        if d.finished:
            return self.write(d)
        prompt = self.prompter.prompt(d)
        room = self.spec.max_length - len(prompt)
        if room <= 0:  # the turns done are kept: the conversation ends before this one (docs/generate.md)
            why = too_long(d.next_message, len(prompt), self.spec.max_length)
            return self.write(d, ended=why) if d.done else self.write(d, why)
        s = self.sampling
        key = f"{d.id}/{len(d.done)}"
        sampling = Sampling(s.temperature, s.top_p, s.top_k, min(s.max_new_tokens, room))
        seed = request_seed(self.spec.seed, self.plan.row(d.id).key, len(d.done))
        self.active[key] = (d, prompt)
        chat = None
        if self.engine.renders:  # it renders the messages itself: they go with the request
            chat = json.dumps(
                {"messages": d.messages, "tools": d.tools, "template_kwargs": self.spec.template_kwargs},
                ensure_ascii=False,
            )
        self.engine.submit(Request(key, tuple(int(i) for i in prompt), sampling, seed, chat))

    def outcome(self, outcome) -> None:
        d, prompt = self.active.pop(outcome.key)
        if not isinstance(outcome, Completion):
            return self.write(d, f"engine failed on turn {d.next_message}: {outcome.reason}")
        if self.engine.renders:  # what it rendered and ran is the turn's prompt
            prompt = np.asarray(outcome.prompt_ids, dtype=np.int32)
        elif tuple(outcome.prompt_ids) != tuple(int(i) for i in prompt):
            raise CaptureFailed(
                f"the {self.engine.name} engine ran other prompt ids than asked for request {outcome.key} "
                f"({len(outcome.prompt_ids)} ids, asked {len(prompt)}): refusing to keep a sample it did not see"
            )
        completion = np.asarray(outcome.completion_ids, dtype=np.int32)
        self.prompter.answer(d, prompt, completion, outcome.finish_reason, outcome.message)
        self.summary.turns += 1
        self.summary.new_tokens += len(completion)
        if why := dropped(d.done[-1], self.spec.drop):
            return self.write(d, why)
        self.advance(d)

    def write(self, d: Dialogue, reason: str | None = None, ended: str | None = None) -> None:
        """Hand ``d``'s file to the writer threads; it counts once ``collect`` has it durable. ``reason``:
        rejected; ``ended``: kept up to its last generated answer, the messages after it dropped."""
        row = self.plan.row(d.id)
        messages = d.messages[: d.done[-1].message + 1] if ended else d.messages
        d.ended = d.ended or ended
        rec = ConversationRecord(
            d.id,
            row.key,
            Source(row.source_file, row.source_row, row.source_id),
            row.sample,
            messages,
            d.done,
            reason,
            d.ended,
            d.tools,
        )
        if reason is not None:
            self.progress.note_error(f"conversation {row.key} rejected: {reason}")
        parts, digest = encode_record(rec)
        self.guard(sum(memoryview(p).nbytes for p in parts))
        self.writing[self.writer.submit_encoded(d.id, parts, digest)] = (d, reason)

    def collect(self, wait: bool) -> None:
        """Count the files written since (all of them when ``wait``): their folders fsynced first, each
        shard sealed after its last file. The writers' first error (a full disk) is raised here."""
        finished = list(self.writing) if wait else [f for f in self.writing if f.done()]
        if not finished:
            return
        self.count(finished, self.writer.wait(finished))  # durable now; all of them, or the first error is raised

    def count(self, futures: list[Future], records: list[FileRecord], seal_shards: bool = True) -> None:
        for future, record in zip(futures, records, strict=True):
            d, reason = self.writing.pop(future)
            shard = layout.shard_of(d.id, self.spec.shard_size)
            self.shards[shard][d.id] = record
            self.left[shard] -= 1
            if not self.left[shard] and seal_shards:
                seal(self.run, shard, list(self.shards[shard].values()))
            self.summary.written += 1
            self.summary.rejected_now += reason is not None
            self.summary.ended_now += d.ended is not None and reason is None
            new_tokens = sum(len(t.completion_ids) for t in d.done)
            self.progress.add_conversation(int(self.plan.lengths[d.id]), len(d.done), new_tokens, record.size)


def dropped(turn: GeneratedTurn, drop: list[str]) -> str | None:
    """Why ``--drop`` rejects a conversation at this answer, or None: an answer with no text, or one
    the length limit cut (``--max-new-tokens``, or the room ``--max-length`` left it)."""
    if "empty" in drop and not turn.text.strip():
        return f"turn {turn.message}: the generated answer is empty (--drop empty)"
    if "length" in drop and turn.finish_reason == "length":
        return f"turn {turn.message}: the generated answer was cut at the length limit (--drop length)"
    return None


def generate(opts: GenerateOptions, log: Callable[[str], None] = print) -> GenerateSummary:
    """Generate into ``opts.out`` (a new run, or the resume of one) to the end or a clean stop."""
    spec = open_gen_run(opts, log)
    run = opts.out
    run.mkdir(parents=True, exist_ok=True)
    engine: Engine | None = None
    progress = GenProgress(BYTES_PER_TOKEN, run, opts.log_every)
    with locked(opts, progress.metrics, log):
        try:
            if spec is None:  # a new run: plan, engine, then the spec, last
                try:
                    plan_id = plan_run(opts, log)
                    model_dir = target.resolve(opts.model)
                    stops = stop_ids(model_dir, target.load_tokenizer(model_dir, opts.trust_remote_code))
                    settings = opts.engine_settings(
                        model_dir, opts.get("dtype"), opts.trust_remote_code, opts.get("seed"), opts.get("max_length"),
                        stops,
                    )  # fmt: skip
                    engine = _open(opts.get("backend"), settings, log, progress)
                    spec = create_spec(opts, plan_id, engine)
                except BaseException as e:  # the folder now holds a start that never became a run: say so in it
                    record_failed_start(opts, e)
                    raise
            progress.total_samples, progress.total_tokens = spec.plan.num_samples, spec.plan.num_tokens
            plan = load_gen_plan(run, spec)
            summary = GenerateSummary(run, spec.plan.num_samples)
            begun = Prologue.open(opts, spec, plan.lengths, log)
            progress.start(0, 0)
            verifier = begun.verify(progress.add_done)
            try:
                todo = verifier.rest()
            finally:
                verifier.stop()
            summary.already_done, summary.redone = begun.summary.already_done, begun.summary.redone
            if todo:
                model_dir = target.model_dir_for(run, spec, opts.model, checked=False)
                tokenizer = target.load_tokenizer(model_dir, spec.trust_remote_code)
                stops = stop_ids(model_dir, tokenizer)  # the engine stops where the job ends a turn
                if engine is None:
                    settings = opts.engine_settings(
                        model_dir, spec.dtype, spec.trust_remote_code, spec.seed, spec.max_length, stops
                    )
                    engine = _open(spec.engine.name, settings, log, progress)
                check_engine(spec, engine)
                parses = spec.tool_parser not in (None, toolcalls.ENGINE)
                recognize = toolcalls.Recognizer(tokenizer, spec.tool_parser) if parses else None
                prompter = Prompter(Tokenize(tokenizer, spec.max_length, spec.template_kwargs), stops, recognize)
                t0 = time.monotonic()
                progress.clock()
                try:
                    ConversationLoop(
                        spec, run, plan, engine, prompter, progress, begun.space.reserve, summary
                    ).run_shards(todo)
                except DiskFull as e:  # the guard's reserve reached, or a real ENOSPC: every file whole or absent
                    raise begun.clean_stop(summary, e.path, e.reason) from e
                finally:
                    summary.seconds = time.monotonic() - t0
            write_rejects(run, spec)
            return summary
        finally:
            if engine is not None:
                engine.close()


def _open(backend: str, settings: EngineSettings, log: Callable[[str], None], progress: GenProgress) -> Engine:
    """The engine, and a word when transformers is asked to generate with a large model. What the
    engine goes on through (a server's retries and outages) is logged and named by the next progress line."""

    def trouble(message: str) -> None:
        progress.note_error(message)
        log(message)

    engine = open_engine(backend, replace(settings, log=trouble))
    if engine.name == "transformers":
        params = sum(f.stat().st_size for f in settings.model_dir.glob("*.safetensors")) / 2  # bf16 checkpoints
        if params > LARGE:
            log(
                f"note: a model of about {params / 1e9:.0f}B parameters generated with transformers runs at a few "
                "hundred tokens/s; vLLM (--backend vllm) or a running server (--backend server) is the production route"
            )
    log(f"engine: {engine.name} {engine.version}")
    return engine


def write_rejects(run, spec: GenerateSpec) -> int:
    """``rejects.jsonl``: the rows planning rejected, then the conversations rejected while generating
    (read from their verified files), replaced whole. Returns how many conversations were rejected."""
    lines = (run / layout.PLAN_DIR / PLAN_REJECTS).read_text()
    later = 0
    for cid, status in statuses(run, spec.plan.num_samples, spec.shard_size).items():
        if status != "rejected":  # the header says which are rejected: only those are read whole
            continue
        try:
            rec = read_record(layout.sample_path(run, cid, spec.shard_size), cid)
        except (OSError, BadFile):
            continue
        src = InputSource(rec.source.file, rec.source.row, rec.source.id)
        lines += json.dumps(Reject(src, rec.reason or "").to_json() | {"key": rec.key}) + "\n"
        later += 1
    write_durable(run / layout.REJECTS, lines.encode())
    return later
