"""Generation through inference servers a user already runs (vLLM, SGLang, TRT-LLM), token-exact.

The servers are spoken to through their token-id interfaces, so that nothing is re-tokenized:

- ``openai``: ``POST /v1/completions`` with ``prompt`` as a list of token ids and
  ``return_token_ids: true`` (vLLM >= 0.10.2); the answer gives back ``prompt_token_ids`` and
  ``token_ids``.
- ``openai-chat``: ``POST /v1/chat/completions`` with the conversation's messages and tools and
  ``return_token_ids: true`` (vLLM >= 0.10.2): the server renders the prompt with its own template
  and reads the answer with its own reasoning and tool parsers (``vllm serve --tool-call-parser ...
  --reasoning-parser ...``); the answer gives back ``prompt_token_ids`` (what it ran: the turn's
  prompt) and the choice's ``token_ids`` and parsed ``message``.
- ``sglang``: SGLang's native ``POST /generate`` with ``input_ids``; the answer gives back
  ``output_ids`` and, where the server returns them (``--return-token-ids``), ``input_ids``;
  otherwise only the prompt's length (``meta_info.prompt_tokens``) can be compared.

A server that ran other prompt ids than the request's yields a ``Failure`` with that reason (the
conversation becomes a reject), never a silent sample. Every sampling value is sent explicitly:
a server otherwise fills in the model's ``generation_config.json`` defaults.

Transient faults (HTTP 408/409/425/429/5xx, refused or dropped connections, timeouts) are retried
with exponential backoff (``Retry-After`` honoured), each retry logged with its cause; a request
whose tries are spent goes back to the queue (another server or a restarted one takes it) and
counts as one failure. After
``max_failures`` such failures in a row with no success between, the engine stops:
``poll`` raises ``EngineUnavailable`` and the job stops cleanly, leaving the run resumable; the
requests in flight are simply redone by the resume. Faults of the setup (a wrong URL or model
name, an unauthorized key, a server that returns no token ids) stop it at once: retrying them
would reject every conversation for the same reason. An answer that parses but is not what the API
promises (a field missing or of another type, token ids that are not integers) is a failed try, its
cause logged, under the same retries and ``max_failures``. Anything else a worker thread meets is a
bug of hsx: ``poll`` raises it, naming the request, rather than leave that request unanswered.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from hsx.errors import EngineUnavailable, OptionError
from hsx.generate.engines import EngineSettings
from hsx.generate.engines.base import Capabilities, Completion, Engine, Failure, Outcome, Request
from hsx.generate.export import openai_message

Api = Literal["openai", "openai-chat", "sglang"]
CHAT = "openai-chat"
FINISHED = {"stop": "stop", "length": "length", "tool_calls": "stop"}  # a chat answer that calls tools stopped
RETRIED = frozenset({408, 409, 425, 429})  # and every 5xx
REQUEST_FAULT = frozenset({400, 413, 422})  # this request is wrong (too long, bad value): a reject
TRANSIENT_ERRORS = (ConnectionError, TimeoutError, http.client.HTTPException, urllib.error.URLError)


@dataclass(frozen=True)
class ServerOptions:
    urls: tuple[str, ...]
    api: Api | None = None  # None: found out per server (SGLang answers GET /get_model_info, vLLM does not)
    model: str | None = None  # the served model name (openai); None: the one the server lists
    concurrency: int = 32  # requests in flight per server
    timeout: float = 3600.0  # seconds one HTTP request may take (a long completion on a busy server)
    retries: int = 5  # tries of one request on one server before it counts as a failure
    backoff: float = 1.0  # first wait between tries; doubles each try
    max_backoff: float = 30.0
    max_failures: int = 10  # failures in a row (no success between) before the engine stops
    api_key: str | None = None  # sent as a bearer token
    log: Callable[[str], None] | None = None  # each retry, spent request and outage, with its cause


class _Transient(Exception):
    """A try that may succeed later; ``wait`` is the server's Retry-After, if it gave one."""

    def __init__(self, message: str, wait: float | None = None):
        super().__init__(message)
        self.wait = wait


class _Malformed(_Transient):
    """An answer that parses but lacks a field or holds another type: a try that failed, since a proxy or
    a server's bug may answer one request so and the next one right; the same answer to every request
    still stops the run, after ``max_failures``."""


class _SetupFault(Exception):
    """The same answer would come for every request: stop instead of rejecting them all."""


class _RequestFault(Exception):
    """This request cannot be served: it becomes a Failure."""


def base_url(url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` all mean the server."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class ServerEngine(Engine):
    """Requests queue up here; ``concurrency`` threads per server take them, each one request at a time."""

    name = "server"

    def __init__(self, options: ServerOptions):
        if not options.urls:
            raise OptionError("the server backend needs at least one --server URL")
        if options.concurrency < 1 or options.retries < 1 or options.max_failures < 1:
            raise OptionError("the server backend's concurrency, retries and max failures must be at least 1")
        if options.api not in (None, "openai", CHAT, "sglang"):
            raise OptionError(f"--server-api must be {CHAT}, openai or sglang, not {options.api!r}")
        self.options = options
        self.urls = [base_url(u) for u in options.urls]
        self.apis = {url: options.api or self._detect(url) for url in self.urls}
        openai = [u for u in self.urls if self.apis[u] in ("openai", CHAT)]
        self.capabilities = _capabilities(options.api)
        self.model = options.model or (self._served_model(openai[0]) if openai else None)
        self.version = ", ".join(sorted({f"{self.apis[u]} {self._server_version(u)}" for u in self.urls}))
        self.max_pending = options.concurrency * len(self.urls) * 2  # a queue that keeps every thread busy
        self._todo: queue.Queue[tuple[Request, int]] = queue.Queue()
        self._done: queue.Queue[Outcome] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet returned by poll
        self._failures = 0  # requests in a row that spent their tries
        self._stopped: Exception | None = None  # EngineUnavailable, or the bug a worker thread met
        self._closing = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve, args=(url,), name=f"hsx-server-{i}-{k}", daemon=True)
            for i, url in enumerate(self.urls)
            for k in range(options.concurrency)
        ]
        for t in self._threads:
            t.start()

    # The Engine contract.

    def submit(self, request: Request) -> None:
        with self._lock:
            self._pending += 1
        self._todo.put((request, 0))

    def poll(self, timeout: float | None = None) -> list[Outcome]:
        """Outcomes finished before a stop are handed out first, so the job keeps them; then the stop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            out = self._drain()
            if out:
                with self._lock:
                    self._pending -= len(out)
                return out
            if self._stopped is not None:
                raise self._stopped
            with self._lock:
                if self._pending == 0:
                    return []
            left = 0.1 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return []
            try:  # short waits: a stop is noticed at once
                self._done.put(self._done.get(timeout=min(0.1, left)))
            except queue.Empty:
                continue

    def _drain(self) -> list[Outcome]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closing.set()
        for t in self._threads:
            t.join(timeout=0.1)

    # The workers.

    def _serve(self, url: str) -> None:
        while not self._closing.is_set() and self._stopped is None:
            try:
                request, spent = self._todo.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._answer(url, request, spent)
            except Exception as e:  # a bug of hsx: a thread that dies here would leave poll waiting forever
                self._crash(request, e)

    def _answer(self, url: str, request: Request, spent: int) -> None:
        try:
            outcome = self._try(url, request)
        except _Transient as e:
            self._failed(request, spent + 1, f"{url}: {e}")
            return
        except _SetupFault as e:
            self._stop(f"a generation server answers as no request can succeed: {url}: {e}; fix that, then")
            return
        with self._lock:
            self._failures = 0
        self._done.put(outcome)

    def _crash(self, request: Request, error: Exception) -> None:
        """The job stops with the bug (``poll`` raises it), the original traceback chained."""
        bug = RuntimeError(
            f"the server engine's thread {threading.current_thread().name} failed on request {request.key}: "
            f"{type(error).__name__}: {error} (a bug of hsx; what is written is kept, the same command resumes)"
        )
        bug.__cause__ = error
        self._halt(bug, str(bug))

    def _log(self, message: str) -> None:
        if self.options.log is not None:
            self.options.log(message)

    def _failed(self, request: Request, spent: int, reason: str) -> None:
        """A request's tries are spent: count it and give it back to the queue (or give up on it once it
        alone has failed ``max_failures`` times while other requests succeed: it is what breaks the server)."""
        with self._lock:
            self._failures += 1
            failures = self._failures
        self._log(
            f"server: request {request.key} failed {self.options.retries} tries ({reason}); "
            f"{failures} of {self.options.max_failures} failures in a row before the run stops"
        )
        if failures > self.options.max_failures:
            return  # the run is stopping (another thread reached the bound first): the resume redoes it
        if failures == self.options.max_failures:  # one thread alone, so the stop names the bound reached
            self._stop(
                f"the generation servers stopped answering: {failures} requests in a row failed after "
                f"{self.options.retries} tries each; last: {reason}; once they answer,"
            )
        elif spent >= self.options.max_failures:
            self._done.put(Failure(request.key, f"failed {spent} times on the servers: {reason}"))
        else:
            self._todo.put((request, spent))

    def _stop(self, why: str) -> None:
        """A clean stop (``EngineUnavailable``): the servers cannot serve, the run is resumable."""
        done = f"{why} resume with the same command (the run stopped cleanly: what is written is kept)"
        self._halt(EngineUnavailable(done), why.rsplit(";", 1)[0])

    def _halt(self, error: Exception, line: str) -> None:
        """``poll`` raises ``error`` from now on; the first stop is the one kept and logged."""
        with self._lock:
            first = self._stopped is None
            if first:
                self._stopped = error
        if first:
            self._log(f"server: the run stops: {line}")

    def _try(self, url: str, request: Request) -> Outcome:
        """One request with its retries on one server."""
        wait = self.options.backoff
        for attempt in range(1, self.options.retries + 1):
            if self._closing.is_set() or self._stopped is not None:
                raise _Transient("the engine is stopping")
            try:
                if self.apis[url] == "openai":
                    return self._openai(url, request)
                if self.apis[url] == CHAT:
                    return self._chat(url, request)
                return self._sglang(url, request)
            except _RequestFault as e:
                return Failure(request.key, f"{url}: {e}")
            except _Transient as e:
                if attempt == self.options.retries:
                    raise
                pause = min(e.wait if e.wait is not None else wait, self.options.max_backoff)
                self._log(
                    f"server {url}: request {request.key} try {attempt}/{self.options.retries} failed ({e}); "
                    f"retrying in {pause:g}s"
                )
                self._closing.wait(pause)
                wait = min(wait * 2, self.options.max_backoff)
        raise AssertionError("unreachable")

    def _post(self, url: str, path: str, body: dict) -> dict:
        return self._http(url + path, json.dumps(body).encode())

    def _http(self, url: str, data: bytes | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.options.api_key:
            headers["Authorization"] = f"Bearer {self.options.api_key}"
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
        try:
            with urllib.request.urlopen(req, timeout=self.options.timeout) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            try:
                detail = e.read()[:300].decode(errors="replace")
            except TRANSIENT_ERRORS:  # the connection dropped while the error's body was read
                detail = ""
            message = f"HTTP {e.code}: {detail}"
            if e.code in RETRIED or e.code >= 500:
                retry_after = e.headers.get("Retry-After", "")
                raise _Transient(message, float(retry_after) if retry_after.isdigit() else None) from None
            if e.code in REQUEST_FAULT:
                raise _RequestFault(message) from None
            raise _SetupFault(f"{url} answered {message}") from None
        except TRANSIENT_ERRORS as e:
            raise _Transient(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        try:
            return json.loads(text)
        except ValueError:
            raise _SetupFault(f"{url} answered something that is not JSON: {text[:200]!r}") from None

    def _ask(self, url: str) -> dict | None:
        """A GET at start: the answer, None where the server has no such route; unreachable: a stop."""
        try:
            return self._http(url)
        except _SetupFault:
            return None
        except _Transient as e:
            raise EngineUnavailable(f"cannot reach {url} ({e}); start the server, then run the same command") from e

    def _detect(self, url: str) -> Api:
        info = self._ask(url + "/get_model_info")
        return "sglang" if info and "model_path" in info else "openai"

    def _server_version(self, url: str) -> str:
        """What the spec records: the server's software version (vLLM and SGLang answer GET /version)."""
        answer = self._ask(url + "/version")
        return str(answer.get("version", "unknown version")) if answer else "unknown version"

    def _served_model(self, url: str) -> str:
        """The model an OpenAI-API server lists (``GET /v1/models``), asked once at start."""
        answer = self._ask(url + "/v1/models") or {}
        models = [m.get("id") for m in answer.get("data", [])]
        if len(models) != 1:
            raise OptionError(f"{url} serves {len(models)} models {models}: choose one with --server-model")
        return models[0]

    def _openai(self, url: str, request: Request) -> Outcome:
        body = {"model": self.model, "prompt": list(request.prompt_ids), **_sampling(request)}
        where = f"{url}/v1/completions"
        choice = _choice(self._post(url, "/v1/completions", body), where)
        ids, prompt = choice.get("token_ids"), choice.get("prompt_token_ids")
        if ids is None or prompt is None:
            raise _SetupFault(
                f"{where} returned no token ids: the server must support return_token_ids "
                "(vLLM >= 0.10.2), or use --server-api sglang"
            )
        reason = choice.get("finish_reason")
        return _outcome(request, _ids(prompt, where, "prompt_token_ids"), _ids(ids, where, "token_ids"), reason)

    def _chat(self, url: str, request: Request) -> Outcome:
        chat = json.loads(request.chat or "{}")
        body = {
            "model": self.model,
            "messages": [openai_message(m) for m in chat.get("messages", [])],
            **({"tools": chat["tools"]} if chat.get("tools") else {}),
            "chat_template_kwargs": chat.get("template_kwargs") or {},
            "add_generation_prompt": True,
            **_sampling(request),
        }
        where = f"{url}/v1/chat/completions"
        answer = _object(self._post(url, "/v1/chat/completions", body), where)
        choice = _choice(answer, where)
        ids, prompt = choice.get("token_ids"), answer.get("prompt_token_ids")
        if ids is None or prompt is None:
            raise _SetupFault(
                f"{where} returned no token ids: the server must support return_token_ids (vLLM >= 0.10.2)"
            )
        prompt, ids = _ids(prompt, where, "prompt_token_ids"), _ids(ids, where, "token_ids")
        finish = choice.get("finish_reason")
        reason = FINISHED.get(finish) if isinstance(finish, str) else None
        if reason is None:
            return Failure(request.key, f"the server finished with {finish!r}, not stop or length")
        message = choice.get("message")
        if not isinstance(message, dict):
            raise _Malformed(f"{where} answered a choice without a message: {_excerpt(choice)}")
        return Completion(request.key, prompt, ids, reason, message)

    def _sglang(self, url: str, request: Request) -> Outcome:
        s = request.sampling
        body = {
            "input_ids": list(request.prompt_ids),
            "sampling_params": {
                "max_new_tokens": s.max_new_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k or -1,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "sampling_seed": request.seed,
                "skip_special_tokens": False,
            },
            "stream": False,
        }
        where = f"{url}/generate"
        answer = _object(self._post(url, "/generate", body), where)
        meta = answer.get("meta_info") or {}
        if not isinstance(meta, dict):
            raise _Malformed(f"{where} answered a meta_info that is not an object: {_excerpt(meta)}")
        ids = answer.get("output_ids", answer.get("token_ids"))
        if ids is None:
            raise _SetupFault(f"{where} returned no output_ids")
        if answer.get("input_ids") is not None:
            prompt = _ids(answer["input_ids"], where, "input_ids")
        else:  # this server does not echo the prompt: compare what it reports, its length
            n, want = meta.get("prompt_tokens"), len(request.prompt_ids)
            if n != want:
                return Failure(request.key, f"{url} ran a prompt of {n} tokens, the request has {want}")
            prompt = request.prompt_ids
        reason = meta.get("finish_reason")
        reason = reason.get("type") if isinstance(reason, dict) else reason
        return _outcome(request, prompt, _ids(ids, where, "output_ids"), reason)


def _object(answer: object, where: str) -> dict:
    if not isinstance(answer, dict):
        raise _Malformed(f"{where} answered {type(answer).__name__}, not an object: {_excerpt(answer)}")
    return answer


def _choice(answer: object, where: str) -> dict:
    """The one choice of an OpenAI API answer."""
    choices = _object(answer, where).get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _Malformed(f"{where} answered without a choice: {_excerpt(answer)}")
    return choices[0]


def _ids(value: object, where: str, field: str) -> tuple[int, ...]:
    """Token ids as JSON integers, strictly: a string, float or bool is no token id of the model's."""
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise _Malformed(f"{where} answered {field} that are not a list of integers: {_excerpt(value)}")
    return tuple(value)


def _excerpt(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _outcome(request: Request, prompt: tuple[int, ...], ids: tuple[int, ...], reason: object) -> Outcome:
    """The completion, once the server is shown to have run exactly the request's prompt."""
    if prompt != request.prompt_ids:
        first = next((i for i, (a, b) in enumerate(zip(prompt, request.prompt_ids, strict=False)) if a != b), None)
        at = f"first difference at position {first}" if first is not None else "one is a prefix of the other"
        return Failure(
            request.key,
            f"the server ran other prompt ids than the request's ({len(prompt)} vs {len(request.prompt_ids)} "
            f"tokens, {at}); nothing was kept",
        )
    if reason not in ("stop", "length"):
        return Failure(request.key, f"the server finished with {reason!r}, not stop or length")
    return Completion(request.key, request.prompt_ids, ids, reason)


def _capabilities(api: str | None) -> Capabilities:
    """A chat API renders the conversation with the server's own template and parses its tool calls."""
    return Capabilities(renders_chat=api == CHAT, parses_tool_calls=api == CHAT)


def capabilities(settings: EngineSettings) -> Capabilities:
    return _capabilities(settings.extra.get("server_api"))


def open(settings: EngineSettings) -> ServerEngine:
    """The engine ``hsx generate --backend server`` runs: ``--server`` URLs, ``--concurrency`` per server;
    ``settings.extra`` may name ``server_api`` (openai | sglang), ``server_model`` and the failure policy
    (``server_retries``, ``server_backoff``, ``server_max_failures``, ``server_timeout``);
    ``HSX_SERVER_API_KEY`` in the environment is sent as a bearer token (a secret stays off the command
    line and out of the run spec)."""
    extra = settings.extra
    policy = {"retries": int, "backoff": float, "max_failures": int, "timeout": float}
    options = ServerOptions(
        urls=settings.servers,
        api=extra.get("server_api"),
        model=extra.get("server_model"),
        concurrency=settings.concurrency,
        api_key=os.environ.get("HSX_SERVER_API_KEY") or None,
        log=settings.log,
        **{name: cast(extra[f"server_{name}"]) for name, cast in policy.items() if f"server_{name}" in extra},
    )
    engine = ServerEngine(options)
    if settings.max_pending:
        engine.max_pending = settings.max_pending
    return engine


def _sampling(request: Request) -> dict:
    """What vLLM's completion and chat endpoints both take: the request's sampling, exactly one
    choice, and the token ids of prompt and completion."""
    s = request.sampling
    return {
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k or -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "seed": request.seed,
        "n": 1,
        "stream": False,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
