"""An extraction's run folder: a new one's plan and rejects (``create_run``; the job saves the spec
last: ``job.stage.open_run``), what a resume asks for in the spec's terms (``asked``), and the
fidelity limits a resume sets for its own session (``session_limits``).

The spec is the only source of truth for a resume: whatever the operator passes again must match
it, and is listed by name where it does not (invariant 3; the steps every job's folder shares:
``job.folder``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hsx import drafts, target, teacher
from hsx.errors import InputError, OptionError, PlanError, Refused
from hsx.extract import backends
from hsx.extract.options import (
    DEFAULTS,
    ExtractOptions,
    resolve_compile,
    resolve_packing,
    resolve_parallel,
    resolve_quantized_compute,
)
from hsx.genrun.spec import GenerateSpec, is_generate_run, load_generate_spec
from hsx.input import check_source, read_conversations
from hsx.job.folder import setting_up
from hsx.job.model import Model
from hsx.plan import NoUsableSamples, Plan, Tokenize, tokenize_all, write_plan
from hsx.spec import (
    FP8_ACTIVATIONS,
    CertifyCheck,
    DataFile,
    FidelityCheck,
    ModelIdentity,
    Parallel,
    PlanIdentity,
    RunSpec,
    now,
    who,
)
from hsx.store import layout
from hsx.store.codec import Codec
from hsx.store.durable import write_durable


def asked(opts: ExtractOptions, model: Model, num_layers: int) -> dict:
    """What the operator gave on the command line, in the spec's terms (for the drift check);
    ``num_layers``: the run's model's, which a draft preset's taps depend on."""
    out: dict = {}
    if opts.model is not None:
        out["model"] = model.identity
        out["tokenizer"] = target.tokenizer_identity(model.tokenizer)
    if opts.data:
        out["data"] = data_files(opts.data, opts.split, opts.limit, opts.column, opts.out)
    out |= opts.rows_asked()
    keys = ("max_length", "batch_tokens", "shard_size", "backend", "codec", "quantized_compute", "expert_slice_gb")
    for key in (*keys, "template_kwargs", "chat_template", "fidelity_stride"):
        out[key] = getattr(opts, key)
    if opts.layers is not None:  # a preset is resolved against the run's model
        out["layers"] = drafts.resolve(opts.layers, num_layers).ids
    if opts.final_state is not None:
        out["final_norm"] = opts.final_state
    if opts.dtype not in (None, "auto"):
        out["dtype"] = opts.dtype
    if opts.teacher is not None:
        out["teacher"] = teacher.parse(opts.teacher).spec()
    out["window"] = opts.window_asked()
    if any(v is not None for v in (opts.tensor_parallel, opts.expert_parallel, opts.pipeline_parallel)):
        out["parallel"] = Parallel(
            tensor=opts.tensor_parallel or 1, expert=opts.expert_parallel or 1, pipeline=opts.pipeline_parallel or 1
        )
    for key, value in (("packed", opts.packing), ("compiled", opts.compile)):
        if value != "auto":  # said out loud on a resume: it must match the run, never silently ignored
            out[key] = value == "on"
    return out


def data_files(
    paths: list[Path], split: str | None, limit: int | None, column: str | None, run: Path
) -> list[DataFile]:
    """What the spec of ``run`` records of each data path: a file's size and digest, a Hugging Face
    dataset's, or a generate run's (its conversations the run planned: ``GeneratedRun.identity``)."""
    from hsx.genrun.samples import GeneratedRun, not_generated

    def one(p: Path) -> DataFile:
        if is_generate_run(p):
            return GeneratedRun.read(p).identity(skip=set(not_generated(run)))
        return DataFile.of(p, split, limit, column)

    return [one(p) for p in paths]


def _generated_input(opts: ExtractOptions) -> Path | None:
    """The generate run that is this extraction's data, if it is one (then it must be the only data)."""
    runs = [p for p in opts.data if is_generate_run(p)]
    if runs and len(opts.data) > 1:
        raise InputError("a generate run is extracted alone: give it as the only --data")
    if runs and (opts.split is not None or opts.limit is not None or opts.column is not None):
        raise InputError(
            f"--split, --limit and --column select rows of files and datasets, not of a generate run ({runs[0]})"
        )
    for flag, value in (("--chat-template-kwargs", opts.template_kwargs), ("--chat-template", opts.chat_template)):
        if runs and value is not None:
            raise InputError(
                f"{flag} renders data files and datasets; a generate run ({runs[0]}) is extracted "
                f"from the token ids it generated, rendered with its own (hsx generate {flag})"
            )
    return runs[0] if runs else None


def given(opts: ExtractOptions, name: str):
    """The option as given, or its default where it was not (never where it was: 0 is not "not given")."""
    value = getattr(opts, name)
    return DEFAULTS[name] if value is None else value


def write_rejects(run: Path, rejects: list) -> None:
    write_durable(run / layout.REJECTS, "".join(json.dumps(r.to_json()) + "\n" for r in rejects).encode())


def refuse_model(opts: ExtractOptions, model: Model) -> None:
    """A new run's model the transformers backend cannot load (its config unreadable, no causal LM
    of it), refused by name before anything is written (``capture.transformers.refuse_unloadable``)."""
    from hsx.capture.transformers import refuse_unloadable, resolve_dtype

    if (opts.backend or "transformers") == "transformers":
        device = opts.resources().device
        refuse_unloadable(model.dir, opts.trust_remote_code, device, resolve_dtype(given(opts, "dtype"), device))


def create_run(opts: ExtractOptions, job_model: Model, log: Callable[[str], None]) -> Callable[[], RunSpec]:
    """A new run (``job.stage.open_run``): everything judged from its options, the model's config and the
    data refused here, before its folder or lock exists; the step that, under the lock, reads and
    tokenizes the data into the frozen plan, writes the rejects and returns its spec (saved last)."""
    from hsx.capture import check_layers
    from hsx.capture.transformers import resolve_dtype

    generated = _generated_input(opts)
    opts.refuse_unused(opts.backend or "transformers", generated is not None)
    for path in opts.data if generated is None else []:
        check_source(path, opts.split, opts.column)
    device = opts.resources().device
    dtype = resolve_dtype(given(opts, "dtype"), device)
    model_dir, tokenizer, model = job_model.dir, job_model.tokenizer, job_model.identity
    taps = drafts.resolve(opts.layers, model.num_layers)
    check_layers(taps.ids, model.num_layers)
    packed = resolve_packing(opts.packing, device, target.load_config(model_dir), dtype, log)
    backend = opts.backend or "transformers"
    final_norm = given(opts, "final_state")
    if backend != "transformers" and not taps.ids:
        raise OptionError(f"--layers {opts.layers}: the {backend} backend captures at least one tap")
    final_state = backends.backend(backend).final_state(model_dir, final_norm)  # vLLM: a norm it can apply
    compiled = resolve_compile(opts.compile, device, backend)
    parallel = resolve_parallel(
        opts.tensor_parallel, opts.expert_parallel, target.load_config(model_dir), backend, opts.pipeline_parallel
    )
    compute = resolve_quantized_compute(opts.quantized_compute, model_dir, device, dtype, parallel, log)
    teach = _teacher(opts, backend, parallel, model_dir)
    max_length, codec = given(opts, "max_length"), Codec(given(opts, "codec"))
    own = generated is not None and is_own(load_generate_spec(generated), model)
    refuse_unread_limit(opts, "floor" if own else "baseline")

    def setup() -> RunSpec:
        source_spec, data = None, None
        with setting_up(opts):
            if generated is not None:  # the target's own token ids, as generated: nothing is rendered again
                from hsx.genrun.samples import plan_samples

                digest = target.tokenizer_identity(tokenizer).digest
                gen, samples = plan_samples(generated, digest, max_length, opts.allow_incomplete, log)
                source_spec, data = gen.spec.digest(), [gen.identity()]  # of the listing it planned from
                log(f"planning from the generate run {generated} (its token ids, masks on the generated completions)")
            else:
                log(f"planning {len(opts.data)} data file(s) with {model.architecture}'s chat template")
                log(f"plan: tokenizer {target.tokenizer_identity(tokenizer).tokenizer_class}")
                if opts.template_kwargs:
                    log(f"plan: the chat template's arguments: {json.dumps(opts.template_kwargs)}")
                rows = read_conversations(opts.data, opts.split, opts.limit, opts.column)
                tokenize = Tokenize(tokenizer, max_length, opts.template_kwargs, opts.chat_template)
                log(f"plan: {tokenize.template_choice}")
                samples = tokenize_all(rows, tokenize)
            try:
                info, rejects = write_plan(opts.out, samples, max_length)
            except NoUsableSamples as e:
                write_rejects(opts.out, e.rejects)
                see = f" (see {opts.out / layout.REJECTS})" if e.rejects else ""
                raise PlanError(f"{e}{see}: nothing to extract, no run was made") from None
            write_rejects(opts.out, rejects)
            if teach is not None:
                teacher.write_vocab(opts.out, teach)
        spec = RunSpec(
            created=now(),
            model_files=True,
            created_by=who(),
            backend=backend,
            final_state=final_state,
            final_norm=final_norm,
            layer_convention=target.layer_convention(target.load_config(model_dir)),
            model=model,
            tokenizer=target.tokenizer_identity(tokenizer),
            layers=taps.ids,
            layers_formula=taps.formula,
            dtype=dtype,
            max_length=max_length,
            batch_tokens=given(opts, "batch_tokens"),
            shard_size=given(opts, "shard_size"),
            trust_remote_code=opts.trust_remote_code,
            packed=packed,
            compiled=compiled,
            codec=codec,
            parallel=parallel,
            quantized_compute=compute,
            fp8_activations=FP8_ACTIVATIONS if compute == "fp8" else None,
            expert_slice_gb=opts.expert_slice_gb,
            template_kwargs=opts.template_kwargs or {},
            chat_template=opts.chat_template,
            data=data or data_files(opts.data, opts.split, opts.limit, opts.column, opts.out),
            generate_spec=source_spec,
            plan=PlanIdentity.of(info, len(rejects)),
            fidelity=_fidelity(opts, own),
            window=opts.window_asked(),
            teacher=None if teach is None else teach.spec(Plan(opts.out).masked_share),
            # vLLM's engine holds its own weights: its runs are certified after the fact (hsx verify --reference)
            certify=CertifyCheck(every=given(opts, "reference_every")) if backend != "vllm" else None,
        )
        log(
            f"plan: {info.num_samples} samples, {info.num_tokens} tokens, {info.num_truncated} truncated, "
            f"{len(rejects)} rejected (see {layout.REJECTS})"
        )
        for line in info.summary():
            log(f"plan: {line}")
        if spec.fidelity is not None:
            f = spec.fidelity
            log(f"fidelity: 1 in {f.stride} masked tokens checked; the run stops under {f.rule()}")
        if spec.teacher is not None:
            log(f"teacher: {spec.teacher} at every loss-masked position, in {dtype}")
        if spec.certify is not None:
            log(f"taps: every sample's checked; {_shadow_rule(spec.certify)}")
        return spec

    return setup


def _teacher(opts: ExtractOptions, backend: str, parallel: Parallel, model_dir: Path) -> teacher.Asked | None:
    """A new run's ``--teacher``, refused where the run cannot compute it."""
    if opts.teacher is None:
        return None
    if backend != "transformers" or parallel.pipeline > 1:
        where = f"the {backend} backend" if backend != "transformers" else "--pipeline-parallel"
        raise OptionError(
            f"--teacher is computed by the transformers backend in one process or a tensor-parallel group; "
            f"{where} does not compute it yet: extract without --teacher, or with the transformers backend "
            "and no pipeline"
        )
    asked = teacher.parse(opts.teacher)
    config = target.load_config(model_dir)
    if "vocab_size" not in config:
        raise OptionError(f"--teacher: {model_dir}/config.json has no vocab_size to check the choice against")
    teacher.check_vocab(asked, int(config["vocab_size"]))
    return asked


def _shadow_rule(check: CertifyCheck) -> str:
    if not check.every:
        return "none recomputed through the plain path"
    return f"1 in {check.every} (and ids below {check.first}) recomputed through the plain path and compared"


# the engines that run the checkpoint hsx fingerprints, in hsx's process (a server's weights are its own)
SAME_WEIGHTS = ("transformers", "vllm")


def is_own(gen: GenerateSpec, model: ModelIdentity) -> bool:
    """A generate run is this model's own greedy output: its engine ran these very weights (the same
    fingerprint, in hsx's process) at temperature 0, so the fidelity check may hold it to a floor."""
    same = gen.engine.name in SAME_WEIGHTS and not gen.model.fingerprint.differences(model.fingerprint)
    return same and gen.sampling.temperature == 0


def _fidelity(opts: ExtractOptions, own: bool) -> FidelityCheck:
    """How a new run checks its fidelity: ``own``, its data is this model's temperature-0 output (a
    floor), else a baseline. Every backend measures it as it captures (vLLM's in its connector)."""
    return FidelityCheck(
        mode="floor" if own else "baseline",
        stride=given(opts, "fidelity_stride"),
        floor=given(opts, "fidelity_floor"),
        drop=given(opts, "fidelity_drop"),
    )


def refuse_unread_limit(opts: ExtractOptions, mode: str) -> None:
    """The limit a run's fidelity rule does not read, refused by name (it was accepted and
    ignored): the floor holds data that is this model's own temperature-0 output, the drop from
    its baseline any other data."""
    if mode == "baseline" and opts.fidelity_floor is not None:
        raise OptionError(
            "--fidelity-floor holds a run whose data is this model's own temperature-0 output (a generate run of "
            "it); this run's data is held to the baseline its first batches set: give --fidelity-drop instead"
        )
    if mode == "floor" and opts.fidelity_drop is not None:
        raise OptionError(
            "--fidelity-drop holds a run to the baseline its first batches set; this run's data is this model's own "
            "temperature-0 output, held to a floor: give --fidelity-floor instead"
        )


def session_limits(opts: ExtractOptions, spec: RunSpec, log: Callable[[str], None]) -> RunSpec:
    """The spec this session runs under: a resume's ``--fidelity-floor``/``--fidelity-drop`` and
    ``--reference-every`` hold for it alone (they change no number written; the spec keeps the run's own)."""
    if opts.reference_every is not None:
        check = (spec.certify or CertifyCheck()).model_copy(update={"every": opts.reference_every})
        log(f"taps: this session's shadow: {_shadow_rule(check)}")
        spec = spec.model_copy(update={"certify": check})
    asked = {k: v for k, v in (("floor", opts.fidelity_floor), ("drop", opts.fidelity_drop)) if v is not None}
    if not asked:
        return spec
    if spec.fidelity is None:
        raise OptionError("this run was made before hsx checked fidelity (its files carry no figure): "
                          "--fidelity-floor and --fidelity-drop apply to runs that check it")  # fmt: skip
    refuse_unread_limit(opts, spec.fidelity.mode)
    limits = spec.fidelity.model_copy(update=asked)
    log(f"fidelity: this session stops under {limits.rule()} (the run's own: {spec.fidelity.rule()})")
    return spec.model_copy(update={"fidelity": limits})


def refuse_other_quantization(run: Path, spec: RunSpec) -> None:
    """A run on the fp8 route resumes only under the activations' quantization it began with: its
    samples would otherwise mix two roundings of the same states."""
    if spec.quantized_compute != "fp8" or spec.fp8_activations == FP8_ACTIVATIONS:
        return
    began = spec.fp8_activations or "compiled torch code (hsx before the quantization kernel)"
    raise Refused(
        f"{run} runs on the FP8 route with its activations quantized by {began}; this hsx quantizes them "
        f"with {FP8_ACTIVATIONS}, which rounds otherwise, and a resume would mix the two in one run. Finish it "
        "with the hsx that began it, or extract again into a new folder"
    )
