"""A generate run's folder: a new one's plan and rejects, its spec (saved last by the job:
``job.stage.open_run``), and what a resume asks for in the spec's terms (``asked``).

The same commit points as an extraction's folder (``extract.folder``; the steps both share:
``job.folder``): the plan and the rejects are written durably first, the spec last, so a folder
without a spec is an interrupted set-up that the next ``hsx generate`` plans again. The spec records
the engine's name and version, which are known once it is open: a new run opens its engine before
its spec is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from hsx import target
from hsx.errors import OptionError, PlanError, Refused
from hsx.generate import toolcalls
from hsx.generate.engine import Engine
from hsx.generate.options import GenerateOptions
from hsx.generate.plan import plan_rows, write_gen_plan
from hsx.generate.server import CHAT
from hsx.generate.spec import EngineIdentity, GenerateSpec, SamplingSpec
from hsx.input import Conversation, Reject, check_source, read_conversations
from hsx.job.folder import remove_stray_temps
from hsx.job.model import Model
from hsx.plan import NoUsableSamples, Tokenize
from hsx.spec import DataFile, PlanIdentity, now, who
from hsx.store import layout
from hsx.store.durable import write_durable

PLAN_REJECTS = "rejects.jsonl"  # in plan/: the rows planning rejected (the run's rejects.jsonl adds later ones)


def asked(opts: GenerateOptions, model: Model) -> dict:
    """What the operator gave, in the spec's terms (for the drift check)."""
    out: dict = {"sampling": opts.sampling_given()}
    if opts.model is not None:
        out["model"] = model.identity
        out["tokenizer"] = target.tokenizer_identity(model.tokenizer)
    if opts.data:
        out["data"] = [DataFile.of(p, opts.split, opts.limit, opts.column) for p in opts.data]
    out |= opts.rows_asked()
    for key in (
        "max_length", "shard_size", "backend", "seed", "turns", "samples_per_prompt", "template_kwargs", "tool_parser"
    ):  # fmt: skip
        out[key] = getattr(opts, key)
    out["drop"] = sorted(opts.drop) if opts.drop is not None else None
    return out


def check_engine(spec: GenerateSpec, engine: Engine) -> None:
    """A resume must generate with the engine (and version) the run started with."""
    have = EngineIdentity(name=engine.name, version=engine.version)
    if have != spec.engine:
        raise Refused(
            f"{spec.engine.name} {spec.engine.version} generated this run; this is {have.name} {have.version}: "
            "a resume with another engine or version would change the tokens (install the run's version)"
        )


def _numbered(opts: GenerateOptions) -> Iterator[tuple[int, Conversation | Reject]]:
    """Each row read, with the number of its source among ``--data``."""
    number = {str(p): i for i, p in enumerate(opts.data)}
    for item in read_conversations(opts.data, opts.split, opts.limit, opts.column):
        yield number[item.source.file], item


def _without_tools(items: Iterator[tuple[int, Conversation | Reject]]) -> Iterator[tuple[int, Conversation | Reject]]:
    """The rows, refused at the first that offers or calls tools: the target's calls could not be read."""
    for file_no, item in items:
        if isinstance(item, Conversation) and (item.tools or any(t.role == "tool" for t in item.turns)):
            raise OptionError(
                f"{item.source.file} row {item.source.row} has tools, and the tokenizer has no response template to "
                f"read the target's calls with: name their format with --tool-parser ({', '.join(toolcalls.PARSERS)})"
            )
        yield file_no, item


def check_new(opts: GenerateOptions, model: Model) -> None:
    """Refuse a new run's model, sampling or data before anything is written (its folder: the job)."""
    model.dir  # noqa: B018  (found, or refused by name)
    opts.sampling()  # refuses what cannot be sampled (several samples per prompt, greedy)
    for path in opts.data:
        check_source(path, opts.split, opts.column)


def plan_run(opts: GenerateOptions, model: Model, log: Callable[[str], None]) -> PlanIdentity:
    """A new run's plan and rejects, written durably; the spec is written last, by the job.
    A plan with no usable row writes its rejects where the refusal says, and no plan."""
    remove_stray_temps(opts.out)
    tokenizer = model.tokenizer
    tokenize = Tokenize(tokenizer, opts.get("max_length"), opts.template_kwargs)
    log(f"planning {len(opts.data)} data file(s) with the model's chat template")
    items = _numbered(opts)
    rows = plan_rows(
        items if opts.server_api == CHAT or toolcalls.choose(tokenizer, opts.tool_parser) else _without_tools(items),
        tokenize,
        opts.get("turns"),
        opts.get("samples_per_prompt"),
        opts.sampling().max_new_tokens,
    )
    try:
        info, rejects = write_gen_plan(opts.out, rows, opts.get("max_length"))
    except NoUsableSamples as e:
        write_durable(opts.out / layout.REJECTS, _jsonl(e.rejects))
        see = f" (see {opts.out / layout.REJECTS})" if e.rejects else ""
        raise PlanError(f"{e}{see}: nothing to generate, no run was made") from None
    write_durable(opts.out / layout.PLAN_DIR / PLAN_REJECTS, _jsonl(rejects))
    write_durable(opts.out / layout.REJECTS, _jsonl(rejects))
    log(f"plan: {info.num_samples} conversations, {len(rejects)} rows rejected (see {layout.REJECTS})")
    plan = PlanIdentity(
        fingerprint=info.fingerprint,
        num_samples=info.num_samples,
        num_tokens=info.num_tokens,
        num_truncated=0,
        num_rejected=len(rejects),
    )
    return plan


def _jsonl(rejects: list[Reject]) -> bytes:
    return "".join(json.dumps(r.to_json()) + "\n" for r in rejects).encode()


def create_spec(opts: GenerateOptions, model: Model, plan: PlanIdentity, engine: Engine) -> GenerateSpec:
    """The spec of a new run (the job saves it last: from then on the folder is a run)."""
    tokenizer = model.tokenizer
    return GenerateSpec(
        created=now(),
        created_by=who(),
        model=model.identity,
        tokenizer=target.tokenizer_identity(tokenizer),
        template_kwargs=opts.template_kwargs or {},
        tool_parser=toolcalls.ENGINE if engine.renders else toolcalls.choose(tokenizer, opts.tool_parser),
        engine=EngineIdentity(name=engine.name, version=engine.version),
        sampling=SamplingSpec.of(opts.sampling()),
        seed=opts.get("seed"),
        turns=opts.get("turns"),
        samples_per_prompt=opts.get("samples_per_prompt"),
        max_length=opts.get("max_length"),
        shard_size=opts.get("shard_size"),
        dtype=opts.get("dtype"),
        trust_remote_code=opts.trust_remote_code,
        data=[DataFile.of(p, opts.split, opts.limit, opts.column) for p in opts.data],
        plan=plan,
        drop=sorted(set(opts.drop or [])),
    )
