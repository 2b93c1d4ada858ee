"""Generation with an in-process vLLM engine, fed continuously.

``vllm.LLM.generate`` takes a fixed list, but the job submits a conversation's next turn only
when its previous turn came back; so hsx drives vLLM's ``LLMEngine`` itself: ``add_request`` per
turn (prompt as token ids, ``TokensPrompt``) and ``step`` to collect finished requests, while the
job keeps ``max_pending`` requests queued (several times vLLM's own batch) so the engine never
runs dry. Token-exact: the prompt ids vLLM reports having run are compared with the request's
(a difference is a ``Failure``, never a sample), the completion ids are vLLM's own.

Importing this module imports vLLM (that is the check that the backend is available).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import vllm
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

from hsx.capture.vllm import close_llm
from hsx.generate.engines import EngineSettings
from hsx.generate.engines.base import Completion, Engine, Failure, Outcome, Request, Sampling, ids_only

QUEUED_BATCHES = 4  # requests kept queued: this many times vLLM's max_num_seqs


def sampling_params(sampling: Sampling, seed: int, stop_ids: frozenset[int] = frozenset()) -> SamplingParams:
    """Every value explicit, so the model's generation_config.json defaults play no part; ``stop_ids``:
    the tokens the job ends a turn on (vLLM keeps the stop token in the completion, as the job expects)."""
    return SamplingParams(
        stop_token_ids=sorted(stop_ids),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_new_tokens,
        seed=seed,
        detokenize=False,  # the job decodes the text for people; vLLM need not
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def open_llm(
    model: Path | str,
    *,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    trust_remote_code: bool = False,
    **engine_args,
) -> vllm.LLM:
    """vLLM on ``model``; ``engine_args`` go to ``vllm.LLM`` as they are (e.g. gpu_memory_utilization)."""
    from vllm.platforms import current_platform

    return vllm.LLM(
        model=str(model),
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=current_platform.is_cpu(),
        seed=0,
        **engine_args,
    )


class VllmEngine(Engine):
    """``llm``: an open ``vllm.LLM`` (``open_llm``); the engine closes it. ``stop_ids``: the tokens every
    request stops on."""

    name = "vllm"
    version = vllm.__version__

    def __init__(self, llm: vllm.LLM, stop_ids: frozenset[int] = frozenset()):
        self.llm, self.stop_ids = llm, stop_ids
        self.engine = llm.llm_engine
        self.max_pending = QUEUED_BATCHES * self.engine.vllm_config.scheduler_config.max_num_seqs
        self._requests: dict[str, Request] = {}  # vLLM request id -> the request
        self._refused: list[Outcome] = []  # requests vLLM would not take (too long for the model, ...)
        self._next = 0

    def submit(self, request: Request) -> None:
        rid = str(self._next)
        self._next += 1
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        try:
            self.engine.add_request(rid, prompt, sampling_params(request.sampling, request.seed, self.stop_ids))
        except (ValueError, VLLMClientError) as e:  # vLLM validates here: longer than max_model_len, ids out of vocab
            self._refused.append(Failure(request.key, f"vLLM refused the request: {e}"))
            return
        self._requests[rid] = request

    def poll(self, timeout: float | None = None) -> list[Outcome]:
        out, self._refused = self._refused, []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._requests and not out:
            for o in self.engine.step():
                if o.finished:
                    out.append(self._outcome(o))
            if deadline is not None and time.monotonic() >= deadline:
                break
        return out

    def _outcome(self, o: vllm.RequestOutput) -> Outcome:
        request = self._requests.pop(o.request_id)
        ran = tuple(o.prompt_token_ids or ())
        if ran != request.prompt_ids:
            return Failure(
                request.key,
                f"vLLM ran other prompt ids than the request's ({len(ran)} vs {len(request.prompt_ids)} tokens)",
            )
        done = o.outputs[0]
        if done.finish_reason not in ("stop", "length"):
            return Failure(request.key, f"vLLM finished the request with {done.finish_reason!r}")
        return Completion(request.key, request.prompt_ids, tuple(done.token_ids), done.finish_reason)

    def close(self) -> None:
        close_llm(self.llm)


capabilities = ids_only  # what it does itself (``engines.capabilities``)


def open(settings: EngineSettings) -> VllmEngine:
    """The engine ``hsx generate --backend vllm`` runs. ``settings.extra`` items go to ``vllm.LLM`` as
    keyword arguments (values parsed as JSON where they parse: ``max_model_len=8192``,
    ``gpu_memory_utilization=0.85``); the parallel sizes are the session's, not the run's. vLLM is sized
    for the run's ``max_length`` (its ``max_model_len``), not for the model's whole context, which
    may not fit; a ``max_model_len`` in ``extra`` is taken as given."""
    engine_args = {}
    for name, value in settings.extra.items():
        if name.startswith("server_"):  # the server backend's knobs
            continue
        try:
            engine_args[name] = json.loads(value)
        except ValueError:
            engine_args[name] = value
    if settings.max_length:
        engine_args.setdefault("max_model_len", settings.max_length)
    llm = open_llm(
        settings.model_dir,
        dtype=settings.dtype,
        tensor_parallel_size=settings.tensor_parallel_size,
        trust_remote_code=settings.trust_remote_code,
        **engine_args,
    )
    engine = VllmEngine(llm, settings.stop_ids)
    if settings.max_pending:
        engine.max_pending = settings.max_pending
    return engine
