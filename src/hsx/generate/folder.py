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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict

from hsx import target
from hsx.errors import OptionError, PlanError, Refused
from hsx.generate import toolcalls
from hsx.generate.dialogue import episode_end, episode_starts
from hsx.generate.engines.base import Capabilities, Engine
from hsx.generate.options import GenerateOptions
from hsx.genrun.plan import Planned, write_gen_plan
from hsx.genrun.spec import EngineIdentity, GenerateSpec, SamplingSpec
from hsx.input import Conversation, Reject, check_source, read_conversations, to_message, tools_of
from hsx.job.folder import remove_stray_temps
from hsx.job.model import Model
from hsx.plan import COUNTS, NoUsableSamples, Tokenize
from hsx.spec import DataFile, PlanIdentity, now, who
from hsx.store import layout
from hsx.store.durable import write_durable


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
        "max_length", "shard_size", "backend", "seed", "turns", "samples_per_prompt", "template_kwargs",
        "chat_template", "tool_parser",
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


def too_long(message: int, tokens: int, limit: int) -> str:
    """The reason a conversation cannot go on: the prompt of one of its turns leaves no room to generate."""
    return f"prompt of turn {message} is {tokens} tokens, not under --max-length {limit}"


def targets_of(messages: list[dict], turns: str) -> list[int]:
    starts = episode_starts(messages)
    return starts if turns == "all" else starts[-1:]


def plan_rows(
    items: Iterable[tuple[int, Conversation | Reject]],
    tokenize: Tokenize,
    turns: str,
    samples: int,
    max_new_tokens: int,
) -> Iterator[Planned | Reject]:
    """(index of its data file, conversation or reject) -> planned rows, ``samples`` per conversation.

    Only what the target is prompted with must render: the turns before the first episode
    regenerated, and with ``--turns last`` the dataset's earlier episodes (their calls and results
    stay in the prompt). With ``--turns all`` the dataset's calls are replaced by the target's own,
    so a template that could not render them (Mistral's call ids, Llama 3.1's single call per turn)
    refuses nothing here."""
    for file_no, item in items:
        if isinstance(item, Reject):
            yield item
            continue
        src = item.source
        messages = [to_message(t) for t in item.turns]
        tools = tools_of(item)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        messages = messages[: episode_end(messages, last)]  # its results stay: the target may call for them
        targets = targets_of(messages, turns)
        try:
            prompts = _prompt_tokens(tokenize, messages, tools, targets)
        except Exception as e:  # a template error on one row must not stop the run
            yield Reject(src, f"chat template cannot render it: {e}")
            continue
        if prompts[0] >= tokenize.max_length:
            yield Reject(src, too_long(targets[0], prompts[0], tokenize.max_length))
            continue
        # each regenerated episode: its prompt and its completion, at most the length limit
        estimate = sum(min(n + max_new_tokens, tokenize.max_length) for n in prompts)
        for s in range(samples):
            key = f"{file_no}:{src.row}#{s}"
            yield Planned(key, src.file, src.row, src.id, s, messages, tools, targets, estimate, item.ids_given)


def _prompt_tokens(tokenize: Tokenize, messages: list[dict], tools: list[dict] | None, targets: list[int]) -> list[int]:
    """The tokens of each regenerated episode's prompt, the dataset's turns standing in for the
    target's answers to come: rendered where they are the prompt (the first episode; every episode
    of ``--turns last``, one only); for a later episode of ``--turns all``, the first prompt and the
    dataset's turns since as JSON text, never rendered (the target's own calls will replace them)."""
    first = len(tokenize.ids(tokenize.render(messages[: targets[0]], True, tools)))
    return [first] + [
        first + len(tokenize.ids(json.dumps(messages[targets[0] : i], ensure_ascii=False))) for i in targets[1:]
    ]


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


def plan_run(opts: GenerateOptions, model: Model, engine: Capabilities, log: Callable[[str], None]) -> PlanIdentity:
    """A new run's plan and rejects, written durably; the spec is written last, by the job. ``engine``:
    what the engine will do itself (one that parses tool calls takes rows with tools whatever the
    tokenizer). A plan with no usable row writes its rejects where the refusal says, and no plan."""
    remove_stray_temps(opts.out)
    tokenizer = model.tokenizer
    tokenize = Tokenize(tokenizer, opts.get("max_length"), opts.template_kwargs, opts.chat_template)
    log(f"planning {len(opts.data)} data file(s) with the model's chat template")
    log(f"plan: {tokenize.template_choice}")
    if opts.template_kwargs:
        log(f"plan: the chat template's arguments: {json.dumps(opts.template_kwargs)}")
    items = _numbered(opts)
    rows = plan_rows(
        items if engine.parses_tool_calls or toolcalls.choose(tokenizer, opts.tool_parser) else _without_tools(items),
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
    write_durable(opts.out / layout.PLAN_DIR / layout.PLAN_REJECTS, _jsonl(rejects))
    write_durable(opts.out / layout.REJECTS, _jsonl(rejects))
    log(f"plan: {info.num_samples} conversations, {len(rejects)} rows rejected (see {layout.REJECTS})")
    if info.call_ids_given:
        log(f"plan: {info.call_ids_given} {COUNTS['call_ids_given']}")
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
        model_files=True,
        created_by=who(),
        model=model.identity,
        tokenizer=target.tokenizer_identity(tokenizer),
        template_kwargs=opts.template_kwargs or {},
        chat_template=opts.chat_template,
        tool_parser=toolcalls.ENGINE
        if engine.capabilities.parses_tool_calls
        else toolcalls.choose(tokenizer, opts.tool_parser),
        engine=EngineIdentity(name=engine.name, version=engine.version),
        sampling=SamplingSpec(**asdict(opts.sampling())),
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
