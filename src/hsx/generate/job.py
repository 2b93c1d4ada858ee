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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xxhash

from hsx import target
from hsx.errors import BadFile, CaptureFailed, Refused, uninterrupted
from hsx.generate import toolcalls
from hsx.generate.dialogue import Dialogue
from hsx.generate.engines import EngineSettings, capabilities, open_engine
from hsx.generate.engines.base import Completion, Engine, Request, Sampling
from hsx.generate.folder import asked, check_engine, check_new, create_spec, plan_run, too_long
from hsx.generate.options import GenerateOptions
from hsx.generate.progress import GenProgress
from hsx.generate.prompts import Prompter, stop_ids
from hsx.genrun.plan import GenPlan, load_gen_plan
from hsx.genrun.record import ConversationRecord, GeneratedTurn, Source, encode_record, read_record, statuses
from hsx.genrun.spec import BYTES_PER_TOKEN, GenerateSpec, generate_differences, load_generate_spec
from hsx.input import Reject
from hsx.input import Source as InputSource
from hsx.job.folder import setting_up
from hsx.job.model import Model
from hsx.job.resume import Summary
from hsx.job.space import DiskGuard
from hsx.job.stage import Job, Stage, run
from hsx.plan import Tokenize
from hsx.store import layout
from hsx.store.durable import write_durable
from hsx.store.scan import ShardScan
from hsx.store.writer import FileRecord, SampleWriter, seal

LARGE = 2e9  # parameters above which the transformers engine is said not to be the production route
WRITERS = 8  # writer threads: a batch finishing in one engine step is written in parallel, off the engine's path
WRITE_AHEAD = 256 << 20  # bytes of finished conversations queued for the writers at most (then the engine waits)
Log = Callable[[str], None]


@dataclass
class GenerateSummary(Summary):
    """What a generate session did, and where the run stands."""

    rejected_now: int = 0  # conversations this session rejected (prompt over the limit, engine failure)
    ended_now: int = 0  # conversations this session kept up to where they ended (a prompt too long, a call unpaired)
    turns: int = 0
    new_tokens: int = 0

    def own_lines(self) -> list[str]:
        rate = f" ({self.new_tokens / self.seconds:,.0f} new tokens/s)" if self.seconds > 0 and self.new_tokens else ""
        return [
            f"convs      {self.done}/{self.total_samples} done, {self.written} written now "
            f"({self.rejected_now} of them rejected, {self.ended_now} ended early), "
            f"{self.already_done} were already verified",
            f"generated  {self.turns} turns, {self.new_tokens:,} new tokens in {self.seconds:.1f}s{rate}",
        ]


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
        self.sampling = Sampling(**spec.sampling.model_dump())
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
                try:
                    while queue or self.active:
                        while queue and len(self.active) < max(self.engine.max_pending, 1):
                            self.start(queue.pop())
                        for outcome in self.engine.poll(None if self.active else 0):
                            self.outcome(outcome)
                        self.collect(wait=False)
                    self.collect(wait=True)
                except BaseException as e:  # a full disk, Ctrl-C, SIGTERM: before the last progress line
                    self.keep_whole()
                    e.add_note(f"{self.summary.done}/{self.summary.total_samples} conversations are done and durable")
                    raise
        finally:
            self.writer.close()  # queued writes finish (or fail and remove their temp files)

    def keep_whole(self) -> None:
        """At a stop: the files written whole before it count, durable (their shards are sealed on resume)."""
        self.writer.close()
        whole = [f for f in self.writing if not f.cancelled() and f.exception() is None]
        self.writer.sync()
        self.count(whole, [f.result() for f in whole], seal_shards=False)

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
        if self.engine.capabilities.renders_chat:  # it renders the messages itself: they go with the request
            chat = json.dumps(
                {"messages": d.messages, "tools": d.tools, "template_kwargs": self.spec.template_kwargs},
                ensure_ascii=False,
            )
        self.engine.submit(Request(key, tuple(int(i) for i in prompt), sampling, seed, chat))

    def outcome(self, outcome) -> None:
        d, prompt = self.active.pop(outcome.key)
        if not isinstance(outcome, Completion):
            return self.write(d, f"engine failed on turn {d.next_message}: {outcome.reason}")
        if self.engine.capabilities.renders_chat:  # what it rendered and ran is the turn's prompt
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
            with uninterrupted():  # a stop between these would leave a durable file uncounted
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


class Generate(Stage[GenerateOptions, GenerateSpec, GenerateSummary]):
    """The generate stage's parts of a job (``job.stage``). A new run opens its engine before its spec
    is written (the spec records the engine's name and version) and keeps it for the work."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.counts: GenProgress | None = None

    def create(self, opts: GenerateOptions, model: Model, log: Log) -> Callable[[], GenerateSpec]:
        backend = opts.get("backend")
        opts.refuse_unused(backend)
        check_new(opts, model)

        def setup() -> GenerateSpec:
            with setting_up(opts):
                stops = stop_ids(model.dir, model.tokenizer)
                settings = opts.engine_settings(
                    model.dir, opts.get("dtype"), opts.trust_remote_code, opts.get("seed"), opts.get("max_length"),
                    stops, model.tokenizer,
                )  # fmt: skip
                plan = plan_run(opts, model, capabilities(backend, settings), log)
                self.engine = self._open(opts, backend, settings, log)
                return create_spec(opts, model, plan, self.engine)

        return setup

    def load(self, run: Path) -> GenerateSpec:
        return load_generate_spec(run)

    def asked(self, opts: GenerateOptions, model: Model, spec: GenerateSpec) -> dict:
        opts.refuse_unused(opts.backend or spec.engine.name)  # options its engine would ignore
        return asked(opts, model)

    def differences(self, spec: GenerateSpec, asked: dict) -> list[str]:
        return generate_differences(spec, asked)

    def progress(self, opts: GenerateOptions, spec: GenerateSpec) -> GenProgress:
        progress = self._progress(opts)
        progress.total_samples, progress.total_tokens = spec.plan.num_samples, spec.plan.num_tokens
        return progress

    def plan(self, run: Path, spec: GenerateSpec) -> GenPlan:
        return load_gen_plan(run, spec)

    def summary(self, run: Path, spec: GenerateSpec) -> GenerateSummary:
        return GenerateSummary(run, spec.plan.num_samples)

    def work(self, job: Job[GenerateOptions, GenerateSpec, GenerateSummary]) -> None:
        """Verify every file first (the engine runs beside nothing), then generate what is missing."""
        opts, spec, progress, summary = job.opts, job.spec, job.progress, job.summary
        progress.start(0, 0)
        verifier = job.verify()
        try:
            todo = verifier.rest()
        finally:
            verifier.stop()
        if todo:
            tokenizer = job.model.tokenizer
            stops = stop_ids(job.model.dir, tokenizer)  # the engine stops where the job ends a turn
            if self.engine is None:
                settings = opts.engine_settings(
                    job.model.dir, spec.dtype, spec.trust_remote_code, spec.seed, spec.max_length, stops, tokenizer
                )
                self.engine = self._open(opts, spec.engine.name, settings, job.log)
            check_engine(spec, self.engine)
            parses = spec.tool_parser not in (None, toolcalls.ENGINE)
            recognize = toolcalls.Recognizer(tokenizer, spec.tool_parser) if parses else None
            prompter = Prompter(
                Tokenize(tokenizer, spec.max_length, spec.template_kwargs, spec.chat_template), stops, recognize
            )
            t0 = time.monotonic()
            progress.clock()
            try:
                loop = ConversationLoop(
                    spec, job.run, job.plan, self.engine, prompter, progress, job.begun.space.reserve, summary
                )
                with target.Digests(job.run, job.spec, job.model.dir):  # the weights' full digests, beside the work
                    loop.run_shards(todo)
            finally:
                summary.seconds = time.monotonic() - t0
        write_rejects(job.run, spec)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def _progress(self, opts: GenerateOptions) -> GenProgress:
        if self.counts is None:
            self.counts = GenProgress(BYTES_PER_TOKEN, opts.out, opts.log_every)
        return self.counts

    def _open(self, opts: GenerateOptions, backend: str, settings: EngineSettings, log: Log) -> Engine:
        """The engine, and a word when transformers is asked to generate with a large model. What the
        engine goes on through (a server's retries and outages) is logged and named by the next progress line."""
        progress = self._progress(opts)

        def trouble(message: str) -> None:
            progress.note_error(message)
            log(message)

        engine = open_engine(backend, replace(settings, log=trouble))
        if not engine.capabilities.returns_token_ids:  # every turn is kept as the ids the target ran and produced
            raise Refused(f"the {engine.name} engine does not return token ids: hsx generate cannot keep its turns")
        if engine.name == "transformers":
            params = sum(f.stat().st_size for f in settings.model_dir.glob("*.safetensors")) / 2  # bf16 checkpoints
            if params > LARGE:
                log(
                    f"note: a model of about {params / 1e9:.0f}B parameters generated with transformers runs at a few "
                    "hundred tokens/s; vLLM (--backend vllm) or a running server (--backend server) is the production "
                    "route"
                )
        log(f"engine: {engine.name} {engine.version}")
        return engine


def generate(opts: GenerateOptions, log: Log = print) -> GenerateSummary:
    """Generate into ``opts.out`` (a new run, or the resume of one) to the end or a clean stop: the job
    (``job.stage.run``) of the generate stage."""
    return run(Generate(), opts, log)


def write_rejects(run, spec: GenerateSpec) -> int:
    """``rejects.jsonl``: the rows planning rejected, then the conversations rejected while generating
    (read from their verified files), replaced whole. Returns how many conversations were rejected."""
    lines = (run / layout.PLAN_DIR / layout.PLAN_REJECTS).read_text()
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
