"""The job skeleton (``hsx.job.stage``): what a job resolves once and hands down."""

from __future__ import annotations

from conftest import TINY, conversations, write_jsonl
from hsx import target
from hsx.generate.job import generate
from hsx.generate.options import GenerateOptions


def test_a_new_generate_run_resolves_its_model_and_loads_its_tokenizer_once(tmp_path, monkeypatch):
    """Planning, the engine's stop tokens, the engine itself and the spec all read the one model the job
    resolved and the one tokenizer it loaded (the code before loaded the tokenizer 5 times and resolved
    the model 5 times); its fingerprint is read once too."""
    from transformers import AutoTokenizer

    calls = {"tokenizer": 0, "resolve": 0, "identity": 0}
    load, resolve, identity = AutoTokenizer.from_pretrained, target.resolve, target.identity

    def counted(name, real):
        def call(*args, **kw):
            calls[name] += 1
            return real(*args, **kw)

        return call

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counted("tokenizer", load))
    monkeypatch.setattr(target, "resolve", counted("resolve", resolve))
    monkeypatch.setattr(target, "identity", counted("identity", identity))
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(3))
    opts = GenerateOptions(out=tmp_path / "gen", model=str(TINY), data=[data], device="cpu", max_new_tokens=2)
    summary = generate(opts, log=lambda m: None)
    assert summary.complete and summary.written == 3
    assert calls == {"tokenizer": 1, "resolve": 1, "identity": 1}
