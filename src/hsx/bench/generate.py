"""hsx bench --generate: what ``hsx generate`` costs next to its engine's own bare throughput.

In one run, on the same prompts and sampling:
- hsx: ``hsx generate --backend vllm --turns last`` on N conversations (run folder, plan, the job
  keeping vLLM's queue full, every conversation written durably and self-verifying); its new
  tokens/s are the job's own (new tokens over the generation loop's time, model load excluded);
- vllm: ``vllm.LLM.generate`` over exactly the prompt ids hsx ran, all at once, with the same
  per-request sampling and seeds, outputs discarded (the engine's ceiling on this batch);
- engine alone: hsx's vLLM engine through the Engine contract on the same requests, nothing
  written (the contract's cost, apart from the job's rendering and durable writes).
Each runs on a fresh vLLM (as hsx generate does), so none is served from another's prefix cache.
``--turns last`` makes every prompt known up front, so the bare engine gets the whole batch at once.
After the table: hsx / vllm, and how many completions are token-identical between the two (all of
them, greedy or seeded: vLLM's per-request seeds do not depend on the batch).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hsx.generate.engines.base import Completion, Engine, Request, Sampling
from hsx.generate.job import generate, request_seed
from hsx.generate.options import GenerateOptions
from hsx.generate.prompts import stop_ids
from hsx.genrun.record import read_record
from hsx.genrun.spec import load_generate_spec
from hsx.store import layout
from hsx.target import load_tokenizer, resolve
from hsx.tinymodel import bundled_path


@dataclass
class GenResult:
    name: str
    requests: int
    new_tokens: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def _rows(data: Path | None, n: int, out: Path) -> Path:
    """The first ``n`` conversations of ``data`` (default: the bundled ShareGPT sample) as JSONL."""
    if data is not None:
        return data
    rows = json.loads(bundled_path("data/sharegpt_dummy_conversation.json").read_text())[:n]
    path = out / "convs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_generate_bench(
    model: str | None,
    conversations: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    data: Path | None = None,
    workdir: Path | None = None,
    log: Callable[[str], None] = print,
) -> tuple[list[GenResult], int]:
    """The two measurements, and how many of hsx's completions the bare engine reproduced token for token."""
    from vllm.inputs import TokensPrompt

    from hsx.capture.vllm import close_llm
    from hsx.generate.engines.vllm import VllmEngine, open_llm, sampling_params

    model = model or str(bundled_path("tiny-llama"))
    with tempfile.TemporaryDirectory(dir=workdir, prefix="hsx-bench-gen-") as tmp:
        out = Path(tmp) / "gen"
        opts = GenerateOptions(
            out=out,
            model=model,
            data=[_rows(data, conversations, Path(tmp))],
            backend="vllm",
            turns="last",
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
        )
        summary = generate(opts, log=log)
        spec = load_generate_spec(out)
        hsx = GenResult("hsx generate", summary.turns, summary.new_tokens, summary.seconds)

        records = [read_record(layout.sample_path(out, i, spec.shard_size), i) for i in range(spec.plan.num_samples)]
        turns = [(r, t) for r in records for t in r.turns]
        s = Sampling(**spec.sampling.model_dump())
        prompts = [TokensPrompt(prompt_token_ids=t.prompt_ids.tolist()) for _, t in turns]
        requests = [
            Request(
                f"{r.key}/0",
                tuple(t.prompt_ids.tolist()),
                Sampling(s.temperature, s.top_p, s.top_k, min(s.max_new_tokens, spec.max_length - len(t.prompt_ids))),
                request_seed(spec.seed, r.key, 0),  # --turns last: each conversation's one request is its turn 0
            )
            for r, t in turns
        ]
        model_dir = resolve(model)
        stops = stop_ids(model_dir, load_tokenizer(model_dir, spec.trust_remote_code))  # as hsx generate's
        params = [sampling_params(q.sampling, q.seed, stops) for q in requests]
        # Each measurement on a fresh vLLM, sized as hsx generate's: none is served from another's cache or warm-up.
        sized = {"dtype": spec.dtype, "tensor_parallel_size": tensor_parallel_size, "max_model_len": spec.max_length}
        llm = open_llm(model, **sized)
        try:
            t0 = time.monotonic()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.monotonic() - t0
        finally:
            close_llm(llm)
        new_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        bare = GenResult("vllm LLM.generate", len(outputs), new_tokens, seconds)
        engine = VllmEngine(open_llm(model, **sized), stops)
        try:
            alone = _engine_alone(engine, requests)
        finally:
            engine.close()
        same = sum(
            tuple(o.outputs[0].token_ids) == tuple(t.completion_ids.tolist())
            for o, (_, t) in zip(outputs, turns, strict=True)
        )
    return [bare, alone, hsx], same


def _engine_alone(engine: Engine, requests: list[Request]) -> GenResult:
    """hsx's engine through the Engine contract on the same requests, nothing written: what the
    contract costs, apart from the job's own work (rendering, durable writes)."""
    t0 = time.monotonic()
    for q in requests:
        engine.submit(q)
    new_tokens = done = 0
    while done < len(requests):
        for o in engine.poll():
            done += 1
            new_tokens += len(o.completion_ids) if isinstance(o, Completion) else 0
    return GenResult("hsx engine alone", done, new_tokens, time.monotonic() - t0)


def generate_table(results: list[GenResult], same: int) -> str:
    bare = results[0]
    lines = [f"{'':20} {'requests':>9} {'new tokens':>11} {'seconds':>8} {'new tok/s':>10} {'x bare':>7}"]
    for r in results:
        ratio = r.rate / bare.rate if bare.rate else 0.0
        lines.append(f"{r.name:20} {r.requests:9d} {r.new_tokens:11,d} {r.seconds:8.2f} {r.rate:10,.0f} {ratio:7.3f}")
    lines.append(f"token-identical completions: {same}/{bare.requests}")
    return "\n".join(lines)
