"""The transformers engine: ``model.generate`` in this process, one request at a time.

For the bundled tiny model, tests and small models; an inference engine (``--backend vllm`` or
``server``) is the production route, many times faster on a GPU. One request at a time makes it
deterministic: a request's tokens depend only on its prompt, its sampling and its seed (the RNG is
seeded per request), never on which other requests were running, so a resume that redoes a
conversation draws exactly what the first try drew, and greedy decoding on CPU gives the same bytes.
"""

from __future__ import annotations

from collections import deque

from hsx.generate.engines import EngineSettings
from hsx.generate.engines.base import Completion, Engine, Failure, Outcome, Request, ids_only
from hsx.generate.prompts import stop_ids


class TransformersEngine(Engine):
    name = "transformers"
    max_pending = 1

    def __init__(self, settings: EngineSettings):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.version = f"{transformers.__version__} (torch {torch.__version__})"
        from hsx.job.options import set_threads

        self.device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
        set_threads(settings.threads, self.device)
        dtype = "auto" if settings.dtype == "auto" else getattr(torch, settings.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            settings.model_dir, dtype=dtype, trust_remote_code=settings.trust_remote_code
        )
        self.model.to(self.device).eval()
        tokenizer = settings.tokenizer or AutoTokenizer.from_pretrained(
            settings.model_dir, trust_remote_code=settings.trust_remote_code
        )
        self.stop = settings.stop_ids or stop_ids(settings.model_dir, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(self.stop, default=0)
        self.queue: deque[Request] = deque()

    def submit(self, request: Request) -> None:
        self.queue.append(request)

    def poll(self, timeout: float | None = None) -> list[Outcome]:
        if not self.queue:
            return []
        request = self.queue.popleft()
        try:
            return [self.generate(request)]
        except (RuntimeError, ValueError) as e:  # e.g. out of memory on one long prompt
            return [Failure(request.key, f"transformers generate failed: {e}")]

    def generate(self, request: Request) -> Completion:
        import torch

        s = request.sampling
        sample = s.temperature > 0
        torch.manual_seed(request.seed)  # per request: a redone request draws as the first try did
        prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=s.max_new_tokens,
                do_sample=sample,
                temperature=s.temperature if sample else None,
                top_p=s.top_p if sample else None,  # 1.0: off
                top_k=s.top_k if sample else None,  # 0: off (never the checkpoint's own default)
                eos_token_id=sorted(self.stop) or None,
                pad_token_id=self.pad,
            )
        completion = tuple(out[0, prompt.shape[1] :].tolist())
        finish = "stop" if completion and completion[-1] in self.stop else "length"
        return Completion(request.key, request.prompt_ids, completion, finish)

    def close(self) -> None:
        self.queue.clear()
        del self.model


capabilities = ids_only  # what it does itself (``engines.capabilities``)


def open(settings: EngineSettings) -> TransformersEngine:  # the name engines.open_engine calls
    return TransformersEngine(settings)
