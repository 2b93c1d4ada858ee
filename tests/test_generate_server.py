"""The server backend against a small fake inference server (stdlib http.server on 127.0.0.1): the
retry and backoff policy, the stop after consecutive failures, other prompt ids as a Failure, the
SGLang API, several servers. The real ``vllm serve`` is in test_generate_vllm.py."""

import itertools
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import HANG_GUARD_S, TINY, conversations, hsx, verified_files, write_jsonl
from hsx.errors import EngineUnavailable, OptionError
from hsx.generate.engines.base import Completion, Failure, Request, Sampling
from hsx.generate.engines.server import ServerEngine, ServerOptions

SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5)


def answer_ids(prompt: list[int], n: int) -> list[int]:
    """What the fake model 'generates': a function of the prompt, so each answer is checkable."""
    return [(sum(prompt) + i) % 1000 for i in range(n)]


class Fake:
    """A fake server; ``script`` is a list of (status, headers) answers given before it answers normally;
    ``prompt_edit`` changes the prompt ids it reports; ``echo`` whether it returns the prompt ids (SGLang)."""

    def __init__(self, script=(), prompt_edit=None, echo=True, kind="vllm", stall=False):
        self.script, self.prompt_edit, self.echo = list(script), prompt_edit, echo
        self.stalled = threading.Event() if stall else None  # set: accept every request, never answer
        self.fail_from: int | None = None  # answer HTTP 503 to every request after this many
        self.chat = None  # body -> answer of /v1/chat/completions (None: no such route)
        self.spoil = None  # (body, answer) -> what it answers instead of a good answer (HTTP 200)
        self.posts: list[tuple[float, dict]] = []
        self.headers: list[dict] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body, headers=()):
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def answer(self, body, good):
                self.reply(200, fake.spoil(body, good) if fake.spoil else good)

            def do_GET(self):
                routes = {"/v1/models": {"data": [{"id": "tiny-served"}]}, "/version": {"version": f"{kind}-1.0"}}
                if kind == "sglang":
                    routes["/get_model_info"] = {"model_path": "tiny"}
                if self.path in routes:
                    self.reply(200, routes[self.path])
                else:
                    self.reply(404, {"error": "no such route"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if fake.stalled is not None:  # a hung server: the connection stays open, no answer comes
                    fake.stalled.wait()
                    return
                with fake.lock:
                    fake.posts.append((time.monotonic(), body | {"path": self.path}))
                    fake.headers.append(dict(self.headers))
                    scripted = fake.script.pop(0) if fake.script else None
                    if fake.fail_from is not None and len(fake.posts) > fake.fail_from:
                        scripted = (503, [])
                if scripted:
                    self.reply(scripted[0], {"error": "scripted"}, scripted[1])
                elif self.path == "/v1/completions":
                    prompt = body["prompt"]
                    ran = fake.prompt_edit(prompt) if fake.prompt_edit else prompt
                    ids = answer_ids(prompt, body["max_tokens"])
                    choice = {"text": "x", "token_ids": ids, "prompt_token_ids": ran, "finish_reason": "length"}
                    self.answer(body, {"choices": [choice]})
                elif self.path == "/v1/chat/completions" and fake.chat is not None:
                    self.answer(body, fake.chat(body))
                elif self.path == "/generate":
                    prompt = body["input_ids"]
                    ran = fake.prompt_edit(prompt) if fake.prompt_edit else prompt
                    ids = answer_ids(prompt, body["sampling_params"]["max_new_tokens"])
                    meta = {"prompt_tokens": len(ran), "finish_reason": {"type": "length", "length": len(ids)}}
                    echoed = {"input_ids": ran} if fake.echo else {}
                    self.answer(body, {"text": "x", "output_ids": ids, "meta_info": meta} | echoed)
                else:
                    self.reply(404, {"error": "no such route"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        if self.stalled is not None:
            self.stalled.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    made = []

    def make(**kw):
        made.append(Fake(**kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def request(i: int, n: int = 6) -> Request:
    return Request(f"conv{i}/0/0", tuple(range(i, i + n)), SAMPLING, seed=1000 + i)


def engine(*urls, **kw) -> ServerEngine:
    kw = {"backoff": 0.05, "max_backoff": 1.0, "retries": 4, "max_failures": 3, "concurrency": 1} | kw
    return ServerEngine(ServerOptions(urls=tuple(urls), **kw))


def run_all(eng: ServerEngine, requests: list[Request]) -> dict[str, object]:
    for r in requests:
        eng.submit(r)
    got = {}
    while len(got) < len(requests):
        out = eng.poll(timeout=HANG_GUARD_S)
        assert out, f"no outcome in {HANG_GUARD_S} s: {len(requests) - len(got)} requests left unanswered"
        got |= {o.key: o for o in out}
    assert eng.poll(timeout=0) == []
    return got


def answer(eng: ServerEngine, req: Request):
    """The outcome of one request; the engine is closed after it."""
    try:
        return run_all(eng, [req])[req.key]
    finally:
        eng.close()


def assert_completion(outcome, req: Request):
    assert isinstance(outcome, Completion), outcome
    assert outcome.prompt_ids == req.prompt_ids
    assert list(outcome.completion_ids) == answer_ids(list(req.prompt_ids), req.sampling.max_new_tokens)
    assert outcome.finish_reason == "length"


def test_transient_errors_are_retried_with_growing_waits(fakes):
    fake = fakes(script=[(429, [("Retry-After", "1")]), (503, []), (500, []), (408, [])])
    eng = engine(fake.url, retries=5)
    req = request(1)
    assert_completion(answer(eng, req), req)
    times = [t for t, _ in fake.posts]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 5
    # Retry-After 1 s, then the backoff of the 2nd, 3rd, 4th try: 0.1, 0.2, 0.4 s.
    assert gaps[0] >= 0.95 and gaps[1] >= 0.095 and gaps[2] >= 0.19 and gaps[3] >= 0.38, gaps
    body = fake.posts[-1][1]
    assert body["model"] == "tiny-served"  # the served model, asked for at start
    assert body["prompt"] == list(req.prompt_ids) and body["return_token_ids"] is True
    sent = {k: body[k] for k in ("temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty")}
    want = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 1001, "max_tokens": 5, "repetition_penalty": 1.0}
    assert sent == want


def test_a_bad_request_is_a_failure_at_once_and_the_rest_goes_on(fakes):
    fake = fakes(script=[(400, [])])
    eng = engine(fake.url, model="m")
    reqs = [request(i) for i in range(3)]
    try:
        got = run_all(eng, reqs)
    finally:
        eng.close()
    assert isinstance(got[reqs[0].key], Failure) and "HTTP 400" in got[reqs[0].key].reason
    for r in reqs[1:]:
        assert_completion(got[r.key], r)
    assert len(fake.posts) == 3  # no retry of the bad one


@pytest.mark.parametrize("api", ["openai", "sglang"])
@pytest.mark.parametrize(
    "edit", [lambda p: [*p[:2], p[2] + 1, *p[3:]], lambda p: p[1:]], ids=["changed-token", "dropped-token"]
)
def test_other_prompt_ids_are_a_failure_never_a_sample(fakes, api, edit):
    fake = fakes(prompt_edit=edit)
    eng = engine(fake.url, api=api, model="m")
    req = request(3)
    got = answer(eng, req)
    assert isinstance(got, Failure), got
    assert "other prompt ids than the request's" in got.reason


def test_sglang_api_without_the_prompt_echoed_checks_its_length(fakes):
    good, bad = fakes(echo=False, kind="sglang"), fakes(echo=False, kind="sglang", prompt_edit=lambda p: p[1:])
    reqs = [request(i) for i in range(2)]
    for fake, want in ((good, Completion), (bad, Failure)):
        eng = engine(fake.url)  # found to be SGLang: it answers GET /get_model_info
        assert eng.version == "sglang sglang-1.0" and eng.model is None
        try:
            got = run_all(eng, reqs)
        finally:
            eng.close()
        for r in reqs:
            assert isinstance(got[r.key], want), got[r.key]
            if want is Completion:
                assert_completion(got[r.key], r)
            else:
                assert "ran a prompt of 5 tokens, the request has 6" in got[r.key].reason
        sp = fake.posts[0][1]["sampling_params"]
        assert fake.posts[0][1]["path"] == "/generate" and sp["sampling_seed"] == 1000 and sp["top_k"] == -1


def test_consecutive_failures_stop_cleanly_after_handing_out_what_finished(fakes):
    fake = fakes()
    eng = engine(fake.url, model="m", retries=2, max_failures=3)
    done = [request(i) for i in range(2)]
    try:
        got = run_all(eng, done)
        fake.script = [(503, [])] * 100  # the server now fails everything
        for r in [request(i) for i in range(10, 15)]:
            eng.submit(r)
        with pytest.raises(EngineUnavailable, match="3 requests in a row failed after 2 tries each"):
            while True:
                assert eng.poll(timeout=HANG_GUARD_S) == []
    finally:
        eng.close()
    for r in done:
        assert_completion(got[r.key], r)
    assert len(fake.posts) == 2 + 3 * 2  # one thread: three requests, two tries each, then the stop


def test_refused_connections_count_as_failures(fakes):
    fake = fakes()
    eng = engine(fake.url, model="m", retries=2, max_failures=2)
    fake.close()  # nothing listens there now
    eng.submit(request(0))
    try:
        with pytest.raises(EngineUnavailable, match="Connection refused"):
            eng.poll(timeout=HANG_GUARD_S)
    finally:
        eng.close()


def test_a_wrong_route_stops_at_once(fakes):
    fake = fakes()
    eng = engine(fake.url + "/wrong", model="m")
    eng.submit(request(0))
    try:
        with pytest.raises(EngineUnavailable, match="HTTP 404"):
            eng.poll(timeout=HANG_GUARD_S)
    finally:
        eng.close()
    assert len(fake.posts) == 1


def chat_answer(body):
    """A well-formed chat completion (what vLLM answers with return_token_ids)."""
    message = {"role": "assistant", "content": "x"}
    return {
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"message": message, "token_ids": [5, 6], "finish_reason": "stop"}],
    }


def strings(ids):
    return [str(t) for t in ids]


# api, what the server answers instead of a good answer, what the logged cause says
MALFORMED = {
    "no-choices": ("openai", lambda a: {"object": "text_completion"}, "answered without a choice"),
    "choices-a-string": ("openai", lambda a: {"choices": "x"}, "answered without a choice"),
    "a-list": ("openai", lambda a: [a], "answered list, not an object"),
    "ids-strings": (
        "openai",
        lambda a: {"choices": [a["choices"][0] | {"token_ids": strings(a["choices"][0]["token_ids"])}]},
        "token_ids that are not a list of integers",
    ),
    "prompt-ids-floats": (
        "openai",
        lambda a: {
            "choices": [a["choices"][0] | {"prompt_token_ids": [float(t) for t in a["choices"][0]["prompt_token_ids"]]}]
        },
        "prompt_token_ids that are not a list of integers",
    ),
    "chat-no-message": (
        "openai-chat",
        lambda a: a | {"choices": [{k: v for k, v in a["choices"][0].items() if k != "message"}]},
        "a choice without a message",
    ),
    "chat-ids-strings": (
        "openai-chat",
        lambda a: a | {"prompt_token_ids": strings(a["prompt_token_ids"])},
        "prompt_token_ids that are not a list of integers",
    ),
    "chat-choices-a-string": ("openai-chat", lambda a: a | {"choices": "x"}, "answered without a choice"),
    "sglang-ids-strings": ("sglang", lambda a: a | {"output_ids": strings(a["output_ids"])}, "output_ids that are not"),
    "sglang-meta-a-list": ("sglang", lambda a: a | {"meta_info": [1]}, "meta_info that is not an object"),
    "sglang-a-string": ("sglang", lambda a: "ok", "answered str, not an object"),
}


def served(fakes, api):
    fake = fakes(kind="sglang" if api == "sglang" else "vllm")
    fake.chat = chat_answer
    return fake


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_answer_is_a_failed_try_and_the_run_stops_after_max_failures(fakes, case):
    """An answer that parses but is not what the API promises is a failed try, its cause logged; every
    answer so stops the run after retries x max_failures tries, where a worker thread that died on it
    would leave poll waiting forever."""
    api, spoil, cause = MALFORMED[case]
    fake = served(fakes, api)
    fake.spoil = lambda body, good: spoil(good)
    logs = []
    eng = engine(fake.url, api=api, model="m", retries=2, max_failures=2, log=logs.append)
    eng.submit(request(0))
    try:
        with pytest.raises(EngineUnavailable, match=f"2 requests in a row failed after 2 tries each; last: .*{cause}"):
            assert eng.poll(timeout=HANG_GUARD_S) == []  # raises once the engine stops: no wait on a guessed time
    finally:
        eng.close()
    assert len(fake.posts) == 2 * 2  # the request's two rounds of two tries, then the stop
    retried = [line for line in logs if "try 1/2 failed" in line]
    assert len(retried) == 2 and all(cause in line for line in retried), logs


def test_a_malformed_answer_to_one_request_makes_it_a_failure_and_the_rest_goes_on(fakes):
    """The server answers one prompt malformed, every time: that request ends as a Failure naming the cause
    after max_failures rounds (the others succeed between them), the others complete."""
    fake = served(fakes, "openai")
    bad = request(0)
    fake.spoil = lambda body, good: {"choices": []} if body["prompt"] == list(bad.prompt_ids) else good
    eng = engine(fake.url, model="m", retries=2, max_failures=3)
    reqs = [bad, request(1), request(2)]
    try:
        got = run_all(eng, reqs)
    finally:
        eng.close()
    assert isinstance(got[bad.key], Failure) and "failed 3 times on the servers" in got[bad.key].reason
    assert "answered without a choice" in got[bad.key].reason
    for r in reqs[1:]:
        assert_completion(got[r.key], r)
    assert sum(body["prompt"] == list(bad.prompt_ids) for _, body in fake.posts) == 3 * 2


def test_a_malformed_answer_once_is_retried_and_the_request_completes(fakes):
    fake = served(fakes, "sglang")
    spoiled = []

    def once(body, good):
        spoiled.append(good)
        return good if len(spoiled) > 1 else good | {"output_ids": "abc"}

    fake.spoil = once
    logs = []
    eng = engine(fake.url, log=logs.append)
    req = request(4)
    assert_completion(answer(eng, req), req)
    assert len(fake.posts) == 2 and "output_ids that are not a list of integers" in logs[0], logs


def test_a_bug_in_a_worker_thread_stops_the_job_naming_it(fakes, monkeypatch):
    """Anything else a worker thread meets is a bug of hsx: poll raises it with the request and the
    original error chained (exit 1, a traceback), where the thread's death would have left it waiting."""
    import hsx.generate.engines.server as server_module

    def broken(*args):
        raise KeyError("finish_reason")

    monkeypatch.setattr(server_module, "_outcome", broken)
    fake = fakes()
    eng = engine(fake.url, model="m")
    for i in range(3):
        eng.submit(request(i))
    try:
        with pytest.raises(RuntimeError, match=r"failed on request conv0/0/0: KeyError: 'finish_reason' \(a bug") as e:
            assert eng.poll(timeout=HANG_GUARD_S) == []
    finally:
        eng.close()
    assert isinstance(e.value.__cause__, KeyError)
    assert len(fake.posts) == 1  # no retry of a bug, nor a next request
    with pytest.raises(RuntimeError):  # still stopped at the next poll
        eng.poll(timeout=0)


def test_several_servers_share_the_requests(fakes):
    a, b = fakes(), fakes()
    eng = engine(a.url + "/v1/", b.url, model="m", concurrency=3)
    reqs = [request(i) for i in range(40)]
    try:
        got = run_all(eng, reqs)
    finally:
        eng.close()
    for r in reqs:
        assert_completion(got[r.key], r)
    assert len(a.posts) + len(b.posts) == 40 and a.posts and b.posts
    assert eng.version == "openai vllm-1.0"  # what the run spec records


def test_the_factory_opens_it_from_the_generate_settings(fakes, monkeypatch):
    from hsx.generate.engines import EngineSettings, open_engine

    fake = fakes()
    monkeypatch.setenv("HSX_SERVER_API_KEY", "secret")
    settings = EngineSettings(
        model_dir=TINY, servers=(fake.url,), concurrency=2, extra={"server_model": "m", "server_retries": "2"}
    )
    eng = open_engine("server", settings)
    try:
        assert (eng.options.concurrency, eng.options.retries, eng.model) == (2, 2, "m")
        assert isinstance(run_all(eng, [request(0)])["conv0/0/0"], Completion)
    finally:
        eng.close()
    assert fake.headers[-1]["Authorization"] == "Bearer secret"


def test_hsx_generate_through_a_server_stops_cleanly_then_resumes(fakes, tmp_path, monkeypatch):
    """The job on the server engine: the server fails everything after 6 requests, the run stops with
    EngineUnavailable keeping what finished, and the same command completes it once the server answers."""
    from functools import partial

    import hsx.generate.engines.server as server_module
    from hsx.generate.job import generate
    from hsx.generate.options import GenerateOptions
    from hsx.genrun.record import read_record
    from hsx.genrun.spec import load_generate_spec
    from hsx.store import layout

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the tokenizer is local: no hub lookups
    fake = fakes()
    fake.fail_from = 6
    fast = partial(ServerOptions, retries=2, backoff=0.01, max_failures=3)
    monkeypatch.setattr(server_module, "ServerOptions", fast)
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(8))
    out = tmp_path / "gen"
    args = dict(out=out, backend="server", servers=[fake.url], concurrency=1, turns="last", max_new_tokens=5)
    with pytest.raises(EngineUnavailable, match="stopped answering: 3 requests in a row failed"):
        generate(GenerateOptions(model=str(TINY), data=[data], shard_size=3, **args), log=lambda m: None)
    before = verified_files(out)
    assert len(before) == 6  # every completion handed out before the stop was written
    fake.fail_from = None
    summary = generate(GenerateOptions(**args), log=lambda m: None)
    assert summary.complete and summary.written == 2 and summary.already_done == 6
    after = verified_files(out)
    assert all(after[p] == ident for p, ident in before.items())  # none rewritten
    spec = load_generate_spec(out)
    assert spec.engine.name == "server" and spec.engine.version == "openai vllm-1.0"
    for i in range(8):
        (turn,) = read_record(layout.sample_path(out, i, spec.shard_size), i).turns
        assert turn.completion_ids.tolist() == answer_ids(turn.prompt_ids.tolist(), 5)  # token-exact through the job


def test_a_stalled_server_times_out_logs_each_retry_and_the_run_stops_resumable(fakes, tmp_path):
    """A server that accepts every request and never answers, under hsx generate off a terminal with a
    small --server-timeout: each retry and spent request is logged with its cause (the timeout), the
    last progress line names it, and the run stops cleanly (exit 2); the resume completes it."""
    from hsx.generate.job import generate
    from hsx.generate.options import GenerateOptions
    from hsx.genrun.record import read_record
    from hsx.store import layout

    stalled = fakes(stall=True)
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(4))
    out = tmp_path / "gen"
    first = hsx(
        "generate", "--model", TINY, "--data", data, "--out", out, "--backend", "server", "--server", stalled.url,
        "--concurrency", "4", "--turns", "last", "--max-new-tokens", "5", "--shard-size", "2",
        "--server-timeout", "0.2", "--server-retries", "2", "--server-backoff", "0", "--log-every", "0.05",
        check=False,
    )  # fmt: skip
    err = first.stderr
    assert first.returncode == 2 and "the generation servers stopped answering: 10 requests in a row" in err, err
    assert "resume with the same command" in err
    retries = re.findall(rf"server {stalled.url}: request \S+ try 1/2 failed \((.*)\); retrying in 0s", err)
    assert retries and all("timed out" in why for why in retries), err
    assert re.search(r"server: request \S+ failed 2 tries \(.*timed out\); \d+ of 10 failures in a row", err), err
    assert re.search(r"server: the run stops: the generation servers stopped answering", err), err
    last = [line for line in err.splitlines() if line.startswith("progress ")][-1]
    assert last.startswith("progress done=0/4 ") and "last_error=server" in last and "timed out" in last, last
    assert not any((out / "shards").rglob("*.safetensors")) if (out / "shards").exists() else True
    good = fakes()
    opts = GenerateOptions(out=out, backend="server", servers=[good.url])
    assert generate(opts, log=lambda m: None).complete
    for i in range(4):
        (turn,) = read_record(layout.sample_path(out, i, 2), i).turns
        assert turn.completion_ids.tolist() == answer_ids(turn.prompt_ids.tolist(), 5)


def test_an_unreachable_server_at_start_is_a_clean_stop(fakes):
    fake = fakes()
    url = fake.url
    fake.close()
    with pytest.raises(EngineUnavailable, match="cannot reach"):
        ServerEngine(ServerOptions(urls=(url,)))


def test_options_are_checked():
    with pytest.raises(OptionError, match="at least one --server"):
        ServerEngine(ServerOptions(urls=()))
    with pytest.raises(OptionError, match="openai-chat, openai or sglang"):
        ServerEngine(ServerOptions(urls=("http://127.0.0.1:1",), api="tgi"))


def test_chat_completions_let_the_servers_own_parsers_read_the_calls(fakes, tmp_path, monkeypatch):
    """--server-api openai-chat: the server renders the conversation (tools, the target's calls as
    OpenAI messages, the results) and parses its answer; the job keeps the prompt ids it ran and its
    parsed calls, and answers them with the dataset's results."""
    import shutil

    from transformers import AutoTokenizer

    from hsx.generate.export import openai_message
    from hsx.generate.job import generate
    from hsx.generate.options import GenerateOptions
    from hsx.genrun.record import read_record
    from hsx.genrun.spec import load_generate_spec
    from hsx.input import ToolCall, Turn, to_message
    from hsx.store import layout
    from test_dialogue import TEMPLATE, TOOLS

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    tok = AutoTokenizer.from_pretrained(model)
    call = {
        "id": "chatcmpl-tool-7",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    ran = []

    def chat(body):  # what vLLM answers with --tool-call-parser and --reasoning-parser
        text = tok.apply_chat_template(
            body["messages"], tools=body.get("tools"), add_generation_prompt=True, tokenize=False
        )
        ran.append((body, tok(text, add_special_tokens=False)["input_ids"]))
        if body["messages"][-1]["role"] == "user":
            message = {"role": "assistant", "content": None, "reasoning_content": "Paris.", "tool_calls": [call]}
            return {
                "prompt_token_ids": ran[-1][1],
                "choices": [{"message": message, "token_ids": [5, 6, tok.eos_token_id], "finish_reason": "tool_calls"}],
            }
        message = {"role": "assistant", "content": "Sunny.", "tool_calls": []}
        return {
            "prompt_token_ids": ran[-1][1],
            "choices": [{"message": message, "token_ids": [8, tok.eos_token_id], "finish_reason": "stop"}],
        }

    fake = fakes()
    fake.chat = chat
    turns = (
        Turn("user", "Weather in Paris?"),
        Turn("assistant", "", tool_calls=(ToolCall("get_weather", '{"city": "Paris"}', "a"),)),
        Turn("tool", "RESULT-PARIS", tool_call_id="a"),
        Turn("assistant", "Sunny there."),
    )
    row = {"messages": [openai_message(to_message(t)) for t in turns], "tools": [json.loads(t) for t in TOOLS]}
    data = write_jsonl(tmp_path / "c.jsonl", [row])
    out = tmp_path / "gen"
    opts = GenerateOptions(
        out=out, model=str(model), data=[data], backend="server", servers=[fake.url], server_api="openai-chat",
        concurrency=1, max_new_tokens=5,
    )  # fmt: skip
    assert generate(opts, log=lambda m: None).complete
    spec = load_generate_spec(out)
    assert spec.tool_parser == "engine" and spec.engine.version == "openai-chat vllm-1.0"
    rec = read_record(layout.sample_path(out, 0, spec.shard_size), 0)
    assert rec.ok and rec.ended is None
    assert [t.prompt_ids.tolist() for t in rec.turns] == [p for _, p in ran]  # what the server ran
    assert [t.completion_ids.tolist() for t in rec.turns] == [[5, 6, tok.eos_token_id], [8, tok.eos_token_id]]
    (parsed,) = rec.messages[1]["tool_calls"]
    assert parsed == {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        "id": "chatcmpl-tool-7",
    }
    assert rec.messages[1]["reasoning_content"] == "Paris."
    assert rec.messages[2] == {  # the dataset's result has no name: none is invented
        "role": "tool",
        "content": "RESULT-PARIS",
        "tool_call_id": "chatcmpl-tool-7",
    }
    assert rec.messages[3] == {"role": "assistant", "content": "Sunny."}
    second = ran[1][0]
    assert second["tools"] == [json.loads(t) for t in TOOLS] and second["return_token_ids"] is True
    assert second["messages"][1]["tool_calls"] == [call] and second["messages"][2]["tool_call_id"] == "chatcmpl-tool-7"
