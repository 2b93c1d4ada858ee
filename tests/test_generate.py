"""hsx generate: the target's own answers, token-exact and crash-safe, then extraction of them as they are.

References are independent of hsx's code: transformers' ``model.generate`` on the stored prompt
ids, and the tokenizer's ``apply_chat_template`` on the dataset's and the generated messages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import (
    TINY,
    conversations,
    flip_byte,
    hsx,
    kill_after_new_files,
    remount,
    require,
    run_files,
    save_tiny,
    stopped_cleanly,
    verified_files,
    write_jsonl,
)
from hsx.cli import app
from hsx.errors import OptionError, Refused
from hsx.generate.engines import EngineSettings
from hsx.generate.engines.base import Request, Sampling
from hsx.generate.job import generate
from hsx.generate.options import GENERATE, GenerateOptions
from hsx.genrun.record import read_record
from hsx.input import ROLES
from hsx.store import layout

CONVS = 8
NEW = 8
ENV = {"OMP_NUM_THREADS": "1"}  # every process of these tests computes with one thread: same float sums


def _args(data: Path, out: Path, *extra: str) -> list:
    return ["generate", "--model", TINY, "--data", data, "--out", out, "--max-new-tokens", NEW, "--shard-size", 3,
            "--device", "cpu", *extra]  # fmt: skip


def _rows() -> list:
    bad = [
        {"id": "tool", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]},
        {
            "id": "image",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "content": "a cat"},
            ],
        },
    ]
    return conversations(CONVS - 2) + bad[:1] + conversations(2, start=6) + bad[1:]


@pytest.fixture(scope="module")
def gen_run(tmp_path_factory) -> tuple[Path, Path]:
    """A finished generate run of 8 conversations (and 2 rows it rejects), made by the real command."""
    root = tmp_path_factory.mktemp("gen")
    data = write_jsonl(root / "convs.jsonl", _rows())
    hsx(*_args(data, root / "gen"), env=ENV)
    return data, root / "gen"


def _records(out: Path) -> list:
    spec = json.loads((out / "hsx.json").read_text())
    n, shard_size = spec["plan"]["num_samples"], spec["shard_size"]
    return [read_record(layout.sample_path(out, i, shard_size), i) for i in range(n)]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _opts(out: Path, **kw) -> GenerateOptions:
    return GenerateOptions(out=out, device="cpu", **kw)


def test_greedy_equals_model_generate_on_the_template_prompt(gen_run, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data, out = gen_run
    tok = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY).eval()
    dataset = [json.loads(line) for line in data.read_text().splitlines()]
    good = [row for row in dataset if row.get("id") not in ("tool", "image")]
    records = _records(out)
    assert len(records) == CONVS and all(r.ok for r in records)
    turns = 0
    for rec, row in zip(records, good, strict=True):
        msgs = [{"role": ROLES[m["from"]], "content": m["value"]} for m in row["conversations"]]
        assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        assert [t.message for t in rec.turns] == assistant  # --turns all: every assistant turn
        assert [m for m in rec.messages if m["role"] != "assistant"] == [m for m in msgs if m["role"] != "assistant"]
        first = tok.apply_chat_template(msgs[: assistant[0]], tokenize=False, add_generation_prompt=True)
        assert rec.turns[0].prompt_ids.tolist() == tok(first, add_special_tokens=False)["input_ids"]
        for t in rec.turns:
            prompt = torch.tensor([t.prompt_ids.tolist()])
            ref = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
            )[0, prompt.shape[1]:].tolist()  # fmt: skip
            assert t.completion_ids.tolist() == ref
            assert t.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
            turns += 1
    assert turns > CONVS  # multi-turn conversations were generated turn by turn
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert {r["id"] for r in rejects} == {"tool", "image"} and all(r["reason"] for r in rejects)


def test_each_turn_is_conditioned_on_the_targets_own_earlier_answers(gen_run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    multi = [r for r in _records(gen_run[1]) if len(r.turns) > 1]
    assert multi
    for rec in multi:
        for prev, t in zip(rec.turns, rec.turns[1:], strict=False):
            n, m = len(prev.prompt_ids), len(prev.completion_ids)
            # the previous prompt, then exactly the ids the target produced, then the template's next turn
            assert t.prompt_ids[:n].tolist() == prev.prompt_ids.tolist()
            assert t.prompt_ids[n : n + m].tolist() == prev.completion_ids.tolist()
            assert rec.messages[prev.message]["content"] == prev.text
            text = tok.apply_chat_template(rec.messages[: t.message], tokenize=False, add_generation_prompt=True)
            assert tok.decode(t.prompt_ids.tolist()) == text


def test_metrics_count_conversations_and_the_real_new_tokens(gen_run):
    """metrics.json at the end of the run: what was written, counted from the files, not the plan's estimate."""
    _, out = gen_run
    m = json.loads((out / "metrics.json").read_text())
    records = _records(out)
    assert m["conversations_done"] == m["conversations_total"] == m["samples_done"] == CONVS
    assert m["turns"] == sum(len(r.turns) for r in records)
    assert m["new_tokens"] == sum(len(t.completion_ids) for r in records for t in r.turns) > 0
    assert m["conversations_per_s"] > 0 and m["eta_s"] == 0
    rate = m["new_tokens"] * m["conversations_per_s"] / CONVS  # both over the same generating time
    assert m["new_tokens_per_s"] == m["tokens_per_s"] == pytest.approx(rate)


def test_kill9_then_sigterm_at_progress_points_then_resume_is_byte_identical(gen_run, tmp_path):
    """kill -9, then SIGTERM (a scheduler's stop) off a terminal: the SIGTERM stops cleanly (exit 143,
    no partial file, progress lines logged before it, the resume command printed); the resume as
    printed gives the bytes of an uninterrupted run."""
    data, reference = gen_run
    out = tmp_path / "gen"
    seed = int(os.environ.get("HSX_CRASH_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    verified: dict = {}
    log = tmp_path / "stderr.txt"
    for sig in (signal.SIGKILL, signal.SIGTERM):
        term = sig == signal.SIGTERM
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hsx", *map(str, _args(data, out, *(["--log-every", "0.01"] if term else [])))],
                stdout=subprocess.DEVNULL, stderr=err, env=os.environ | ENV | {"PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
            kill_after_new_files(proc, out, rng.randint(1, 3), seed, sig, log if term else None)
        assert proc.returncode == (143 if term else -signal.SIGKILL), f"seed {seed}: {log.read_text()}"
        now = verified_files(out)
        assert len(now) < CONVS, f"seed {seed}: the kill came after the run had finished"
        for p, ident in verified.items():  # once verified, never rewritten
            assert now.get(p) == ident, f"seed {seed}: {p.name} changed after it had verified"
        verified = now
    err = log.read_text()
    assert re.search(rf"^progress done=\d+/{CONVS} rate=[\d.]+/s eta=(\d+s|-) free=[\d.]+GB last_error=-$", err, re.M)
    durable = len(verified)  # the stop message and the last progress line say exactly what is durable
    last = [line for line in err.splitlines() if line.startswith("progress done=")][-1]
    assert last.startswith(f"progress done={durable}/{CONVS} "), f"seed {seed}: {err}"
    assert (
        f"terminated (SIGTERM); {durable}/{CONVS} conversations are done and durable; resume with: hsx generate --out"
        in err
    ), err
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], "a SIGTERM left a partial file"
    hsx(*shlex.split(err.split("resume with: ")[1].splitlines()[0])[1:], env=ENV)  # the resume, as printed
    assert run_files(out) == run_files(reference), f"seed {seed}"  # no conversation lost, duplicated or changed
    keys = [r.key for r in _records(out)]
    assert len(set(keys)) == CONVS
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    assert (out / "rejects.jsonl").read_bytes() == (reference / "rejects.jsonl").read_bytes()


def test_a_second_generate_on_a_running_run_is_refused_naming_the_first(gen_run, tmp_path):
    """Invariant 4, two real processes: a second hsx generate on a run that another one is writing is
    refused (exit 2) naming its pid, whether it repeats the command or only names --out; the first,
    held still (SIGSTOP) once it holds the lock and has written a conversation, then finishes with the
    bytes of an uninterrupted run."""
    import socket

    from conftest import HANG_GUARD_S
    from hsx.lock import read_holder

    data, reference = gen_run
    out = tmp_path / "gen"
    command = [sys.executable, "-m", "hsx", *map(str, _args(data, out))]
    first = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ | ENV
    )
    try:
        deadline = time.monotonic() + HANG_GUARD_S  # a hang, not a pace: what the loop waits for is a file
        while (h := read_holder(out)) is None or h.pid != first.pid or not verified_files(out):
            assert first.poll() is None, f"the first ended (rc {first.returncode}) before a conversation was written"
            assert time.monotonic() < deadline, f"no conversation written in {HANG_GUARD_S} s"
            time.sleep(0.005)
        first.send_signal(signal.SIGSTOP)  # alive and holding the lock for as long as the test needs
        held = read_holder(out)
        assert held is not None and held.pid == first.pid, "the first finished before it could be held"
        written = verified_files(out)
        for again in (command[3:], ["generate", "--out", out]):
            second = hsx(*again, check=False, env=ENV)
            assert second.returncode == 2, second.stderr
            said = f"another hsx generate process holds this run: pid {first.pid} on {socket.gethostname()}"
            assert said in second.stderr, second.stderr
        assert read_holder(out) == held and verified_files(out) == written  # the second touched nothing
    finally:
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=HANG_GUARD_S)
    assert first.returncode == 0, err
    assert read_holder(out) is None  # released on exit
    status = hsx("status", out, "--deep", check=False)
    assert status.returncode == 0, status.stdout + status.stderr
    assert run_files(out) == run_files(reference)  # no conversation lost, duplicated or changed


def test_a_resume_with_other_settings_is_refused_by_name(gen_run, tmp_path):
    _, out = gen_run
    cases = [
        ({"temperature": 0.7}, "temperature: run has 0.0, asked for 0.7"),
        ({"turns": "last"}, "turns: run has all, asked for last"),
        ({"template_kwargs": {"enable_thinking": False}}, "template kwargs"),
        ({"max_new_tokens": 9}, "max new tokens: run has 8, asked for 9"),
    ]
    for kw, said in cases:
        with pytest.raises(Refused, match="refusing to resume") as e:
            generate(_opts(out, **kw), log=lambda m: None)
        assert said in str(e.value), kw
    other = save_tiny(_tiny_config(), tmp_path / "other", seed=1)  # the run's model files are checked first
    with pytest.raises(Refused, match=r"other is not the run's model:\n  - model\.safetensors: content differs"):
        generate(_opts(out, model=str(other)), log=lambda m: None)

    class Newer:
        name, version = "transformers", "0.0-other"

    from hsx.generate.folder import check_engine
    from hsx.genrun.spec import load_generate_spec

    with pytest.raises(Refused, match=r"0\.0-other"):
        check_engine(load_generate_spec(out), Newer())


def _tiny_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(TINY)


def test_options_are_range_checked_by_name(tmp_path):
    for kw, name in [({"top_p": 0.0}, "--top-p"), ({"max_new_tokens": 0}, "--max-new-tokens"),
                     ({"turns": "some"}, "--turns"), ({"backend": "tgi"}, "--backend")]:  # fmt: skip
        with pytest.raises(OptionError, match=name):
            _opts(tmp_path, **kw)
    with pytest.raises(OptionError, match="--samples-per-prompt"):
        _opts(tmp_path, samples_per_prompt=2).sampling()


def _outside(bound) -> object:
    """A value just outside ``bound``."""
    if bound.choices:
        return "nope"
    step = 1 if bound.integer else 0.5
    if bound.min is not None:
        return bound.min if bound.min_open else bound.min - step
    return bound.max if bound.max_open else bound.max + step


@pytest.mark.parametrize("name", sorted(GENERATE.bounds))
def test_every_bounded_option_is_refused_out_of_range_by_parser_and_api(name, tmp_path):
    value = _outside(GENERATE.bounds[name])
    flag = "--" + name.replace("_", "-")
    out = tmp_path / "gen"
    with pytest.raises(OptionError, match=f"{flag} takes .*, not {value!r}"):
        _opts(out, **{name: value})
    r = CliRunner().invoke(app, ["generate", "--out", str(out), flag, str(value)])
    assert r.exit_code == 2 and f"{flag} takes " in r.output and str(value) in r.output, r.output
    assert not out.exists()


def test_an_out_of_range_option_is_refused_before_anything_is_written(tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    r = hsx(*_args(data, tmp_path / "gen", "--top-p", "1.5"), check=False)
    assert r.returncode == 2 and "--top-p takes a number > 0.0 and <= 1.0, not 1.5" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "gen").exists()


def test_a_start_with_no_usable_row_leaves_its_rejects_and_a_start_command_that_status_names(tmp_path):
    data = write_jsonl(tmp_path / "convs.jsonl", _rows()[CONVS - 2 : CONVS - 1])  # a tool call: rejected
    out = tmp_path / "gen"
    r = hsx(*_args(data, out), check=False)
    assert r.returncode == 2 and f"(see {out / layout.REJECTS})" in r.stderr, r.stderr
    assert [json.loads(x)["id"] for x in (out / layout.REJECTS).read_text().splitlines()] == ["tool"]
    assert not (out / layout.SPEC).exists() and not [p for p in out.rglob("*") if ".tmp-" in p.name]
    status = hsx("status", out, check=False)
    assert status.returncode == 2 and "a start that never became one (no usable samples" in status.stdout
    again = status.stdout.split("start it again: ", 1)[1].splitlines()[0]
    assert shlex.split(again)[:2] == ["hsx", "generate"], again
    rerun = hsx(*shlex.split(again)[1:], check=False)
    assert rerun.returncode == 2 and "no usable samples: all 1 rows were rejected" in rerun.stderr, rerun.stderr


def test_a_redone_request_draws_what_the_first_try_drew():
    from hsx.generate.engines.transformers import open as open_transformers

    engine = open_transformers(EngineSettings(model_dir=TINY, device="cpu"))
    sampling = Sampling(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12)
    out = {}
    for key, seed in (("a", 7), ("b", 8), ("c", 7)):
        engine.submit(Request(key, (1, 91, 1849, 205), sampling, seed))
        (done,) = engine.poll()
        out[key] = done.completion_ids
    engine.close()
    assert out["a"] == out["c"] != out["b"]


def test_extract_takes_the_generated_ids_as_they_are(gen_run, tmp_path):
    from hsx.extract import ExtractOptions, extract
    from hsx.genrun.spec import load_generate_spec
    from hsx.plan import Plan
    from hsx.spec import load_spec

    _, gen = gen_run
    out = tmp_path / "x"
    opts = ExtractOptions(out=out, model=str(TINY), data=[gen], device="cpu", shard_size=4, writers=1)
    assert extract(opts, log=lambda m: None).complete
    plan = Plan(out)
    records = _records(gen)
    assert len(plan) == len(records)  # the tiny template keeps every answer: one sample per conversation
    for i, rec in enumerate(records):
        last = rec.turns[-1]
        want = np.concatenate([last.prompt_ids, last.completion_ids])
        assert plan.input_ids(i).tobytes() == want.astype("<i4").tobytes()
        mask = np.zeros(len(want), dtype=np.int8)
        for t in rec.turns:  # each completion sits where its own prompt ends
            n = len(t.prompt_ids)
            assert want[: n + len(t.completion_ids)].tolist() == [*t.prompt_ids.tolist(), *t.completion_ids.tolist()]
            mask[n : n + len(t.completion_ids)] = 1
        assert plan.loss_mask(i).tolist() == mask.tolist()
    spec = load_spec(out)
    assert spec.generate_spec == load_generate_spec(gen).digest()
    changed = tmp_path / "changed"  # the generate run as input changed since: a resume is refused by name
    shutil.copytree(gen, changed)
    layout.sample_path(changed, 0, 3).unlink()
    with pytest.raises(Refused, match=r"data: .* differ"):
        extract(ExtractOptions(out=out, data=[changed], allow_incomplete=True), log=lambda m: None)


def test_an_unfinished_generate_run_is_extracted_only_when_asked(gen_run, tmp_path):
    from hsx.extract import ExtractOptions, extract
    from hsx.plan import Plan, load_plan
    from hsx.spec import load_spec

    gen = tmp_path / "gen"
    shutil.copytree(gen_run[1], gen)
    layout.sample_path(gen, 4, 3).unlink()
    (layout.shard_dir(gen, 1) / layout.SEALED).unlink()
    with pytest.raises(Refused, match=r"unfinished generate run \(7 of 8"):
        extract(ExtractOptions(out=tmp_path / "x", model=str(TINY), data=[gen], device="cpu"), log=lambda m: None)
    opts = ExtractOptions(out=tmp_path / "y", model=str(TINY), data=[gen], device="cpu", allow_incomplete=True)
    extract(opts, log=lambda m: None)
    assert len(Plan(tmp_path / "y")) == CONVS - 1
    (reject,) = [json.loads(line) for line in (tmp_path / "y" / "rejects.jsonl").read_text().splitlines()]
    assert reject["row"] == 4 and "not generated" in reject["reason"]
    from hsx.assess.status import assess

    progress = assess(tmp_path / "y").get("progress")  # status says what still waits for generation
    assert (progress.data["not_generated"], progress.data["generated_since"]) == (1, 0)
    assert "1 still wait for generation" in " ".join(progress.details)
    shutil.copy2(layout.sample_path(gen_run[1], 4, 3), layout.sample_path(gen, 4, 3))  # generated since
    report = assess(tmp_path / "y")
    progress = report.get("progress")
    assert (progress.data["not_generated"], progress.data["generated_since"]) == (1, 1)
    assert report.resume and any("a resume plans them" in line for line in report.next), report.next
    extract(ExtractOptions(out=tmp_path / "y", data=[gen]), log=lambda m: None)  # the resume takes it (test_follow)
    assert len(load_plan(tmp_path / "y", load_spec(tmp_path / "y"))) == CONVS
    progress = assess(tmp_path / "y").get("progress")
    assert (progress.data["not_generated"], progress.data["generated_since"]) == (0, 0)
    layout.sample_path(gen, 0, 3).unlink()  # a conversation it planned is gone: named once, with what changed
    with pytest.raises(Refused) as refused:
        extract(ExtractOptions(out=tmp_path / "y", data=[gen]), log=lambda m: None)
    (diff,) = [line for line in str(refused.value).splitlines() if line.startswith("  - data:")]
    assert diff.count(str(gen.resolve())) == 1 and "8 files then, 7 of them now" in diff, diff


def test_a_template_that_rewrites_history_gives_one_sample_per_turn(tmp_path):
    """A template that replaces earlier answers (as reasoning templates drop the thinking): the later
    prompts do not hold the earlier completions, so each turn is its own sample."""
    from hsx.genrun.samples import samples_of, whole

    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
        "{{ '<|im_start|>assistant\\n(earlier answer)<|im_end|>\\n' }}{% else %}"
        + template.split("{% for message in messages %}", 1)[1].replace("{% endfor %}", "{% endif %}{% endfor %}", 1)
    )
    data = write_jsonl(tmp_path / "c.jsonl", conversations(3, start=2))  # 6, 4 and 2 messages
    out = tmp_path / "gen"
    generate(_opts(out, model=str(model), data=[data], max_new_tokens=4, shard_size=3), log=lambda m: None)
    (rec,) = [r for r in _records(out) if len(r.turns) == 3]
    assert not whole(rec)
    samples = list(samples_of(rec, out, 4096))
    assert len(samples) == 3
    for s, t in zip(samples, rec.turns, strict=True):
        assert s.input_ids.tolist() == [*t.prompt_ids.tolist(), *t.completion_ids.tolist()]
        assert s.loss_mask.tolist() == [0] * len(t.prompt_ids) + [1] * len(t.completion_ids)


def test_status_and_verify_assess_a_generate_run_and_a_resume_redoes_the_damage(gen_run, tmp_path):
    from hsx.assess.status import assess
    from hsx.assess.verify import verify

    gen = tmp_path / "gen"
    shutil.copytree(gen_run[1], gen)
    report = assess(gen)
    assert report.exit_code == 0 and report.get("progress").data["complete"]
    assert "generated with" in report.get("capture").figure
    bad = layout.sample_path(gen, 5, 3)
    flip_byte(bad, -2)  # in the data section: only the digest tells
    result = verify(gen, deep=True)
    assert result.exit_code == 1 and result.redo_ids() == [5]
    report = assess(gen, deep=True)
    assert report.exit_code == 1 and report.resume == f"hsx generate --out {gen}"
    said = " ".join(CliRunner().invoke(app, ["status", str(gen), "--deep"]).output.split())
    assert "hsx generate repairs this" in said and "hsx generate redoes these samples" in said, said
    assert "no hsx generate process running" in said and "hsx extract" not in said and "extractor" not in said
    r = CliRunner().invoke(app, ["generate-export", str(gen), str(tmp_path / "e.jsonl")])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"conversation file {bad} (conversation 5) is damaged (corrupt" in said, said
    assert f"hsx verify {gen} --repair, then hsx generate --out {gen}, then this export again" in said
    assert not (tmp_path / "e.jsonl").exists() and not list(tmp_path.glob(".e.jsonl*"))
    from hsx.errors import Locked
    from hsx.lock import RunLock

    with RunLock(gen, "generate", warn=lambda m: None), pytest.raises(Locked, match="another hsx generate process"):
        generate(_opts(gen), log=lambda m: None)
    summary = generate(_opts(gen), log=lambda m: None)
    assert summary.written == 1 and summary.redone == {"corrupt": 1}
    assert run_files(gen) == run_files(gen_run[1])
    assert verify(gen, deep=True).exit_code == 0


def test_a_prompt_grown_past_the_limit_ends_its_conversation_keeping_the_turns_before(tmp_path):
    """A later prompt that no longer fits --max-length ends the conversation there: the turns generated
    before it are kept (status ended, with why), exported and extracted; status counts it. A first
    prompt that does not fit rejects its row when planning (nothing to generate)."""
    from hsx.assess.status import assess
    from hsx.generate.export import export_jsonl
    from hsx.genrun.samples import samples_of

    long = {"id": "long", "conversations": [{"from": "human", "value": "word " * 40}, {"from": "gpt", "value": "ok"}]}
    rows = conversations(2, start=0)  # 4 and 2 messages
    data = write_jsonl(tmp_path / "c.jsonl", [*rows, long])
    out = tmp_path / "gen"
    summary = generate(_opts(out, model=str(TINY), data=[data], max_new_tokens=NEW, max_length=30), log=lambda m: None)
    assert (summary.rejected_now, summary.ended_now) == (0, 1)
    two, one = _records(out)
    assert two.ok and two.status == "ended" and len(two.turns) == 1, two
    assert "prompt of turn 3" in two.ended and "--max-length 30" in two.ended
    (turn,) = two.turns
    assert len(turn.prompt_ids) + len(turn.completion_ids) <= 30
    assert [m["role"] for m in two.messages] == ["user", "assistant"]  # ends at its last generated answer
    assert two.messages[0]["content"] == rows[0]["conversations"][0]["value"]
    assert two.messages[1]["content"] == turn.text
    assert one.status == "ok"
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["id"] == "long" and "prompt of turn 1" in reject["reason"], reject
    (sample,) = samples_of(two, out, 4096)  # extraction takes the kept turn, masked on its completion
    assert sample.input_ids.tolist() == [*turn.prompt_ids.tolist(), *turn.completion_ids.tolist()]
    assert sample.loss_mask.tolist() == [0] * len(turn.prompt_ids) + [1] * len(turn.completion_ids)
    progress = assess(out).get("progress")
    assert progress.data["conversations"] == {"ok": 1, "ended": 1, "rejected": 0}
    assert "1 ended early" in " ".join(progress.details)
    done = export_jsonl(out, tmp_path / "e.jsonl")
    assert (done.conversations, done.rejected) == (2, 0)
    lines = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [x["key"] for x in lines] == [two.key, one.key] and lines[0]["messages"] == two.messages
    assert lines[0]["turns"][0]["completion_ids"] == turn.completion_ids.tolist()


def test_turns_last_keeps_the_datasets_earlier_answers_and_samples_per_prompt_draw_apart(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    rows = conversations(2, start=2)  # 6 and 4 messages
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "gen"
    opts = _opts(
        out, model=str(TINY), data=[data], turns="last", samples_per_prompt=2, temperature=1.0, max_new_tokens=6
    )
    generate(opts, log=lambda m: None)
    records = _records(out)
    assert [r.key for r in records] == ["0:0#0", "0:0#1", "0:1#0", "0:1#1"]
    for rec in records:
        row = rows[rec.source.row]
        msgs = [{"role": ROLES[m["from"]], "content": m["value"]} for m in row["conversations"]]
        (turn,) = rec.turns
        assert turn.message == len(msgs) - 1 and rec.messages[:-1] == msgs[:-1]  # earlier answers: the dataset's
        text = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        assert turn.prompt_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert records[0].turns[0].completion_ids.tolist() != records[1].turns[0].completion_ids.tolist()


def test_template_kwargs_reach_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    template = (model / "chat_template.jinja").read_text()
    said = "'<|im_start|>assistant\\n' + ('NO THINK ' if enable_thinking is defined and not enable_thinking else '')"
    (model / "chat_template.jinja").write_text(template.replace("'<|im_start|>assistant\\n'", said))
    data = write_jsonl(tmp_path / "c.jsonl", conversations(1, start=1))
    prompts = {}
    for kwargs in (None, {"enable_thinking": False}):
        out = tmp_path / f"gen{len(prompts)}"
        generate(
            _opts(out, model=str(model), data=[data], template_kwargs=kwargs, max_new_tokens=2), log=lambda m: None
        )
        (rec,) = _records(out)
        prompts[json.dumps(kwargs)] = AutoTokenizer.from_pretrained(model).decode(rec.turns[0].prompt_ids.tolist())
        assert json.loads((out / "hsx.json").read_text())["template_kwargs"] == (kwargs or {})
    assert prompts['{"enable_thinking": false}'].endswith("NO THINK ")
    assert not prompts["null"].endswith("NO THINK ")


def test_an_engine_giving_up_on_a_request_rejects_that_conversation_only(tmp_path, monkeypatch):
    from hsx.generate.engines import transformers as engine_module

    real = engine_module.TransformersEngine.generate

    def failing_on_turn_2(self, request):
        if request.key.endswith("/1"):  # every conversation's second turn
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, request)

    monkeypatch.setattr(engine_module.TransformersEngine, "generate", failing_on_turn_2)
    data = write_jsonl(tmp_path / "c.jsonl", conversations(2, start=0))  # 4 and 2 messages
    out = tmp_path / "gen"
    summary = generate(_opts(out, model=str(TINY), data=[data], max_new_tokens=4), log=lambda m: None)
    assert summary.complete and summary.rejected_now == 1
    two, one = _records(out)
    assert (
        not two.ok
        and two.reason == "engine failed on turn 3: transformers generate failed: CUDA out of memory (injected)"
    )
    assert len(two.turns) == 1 and one.ok
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["key"] == two.key
    monkeypatch.undo()  # a resume does not retry a rejected conversation: it is done, with its reason
    assert generate(_opts(out), log=lambda m: None).written == 0


def test_a_volume_that_fills_stops_cleanly_then_resumes_identical(gen_run, tmpfs, tmp_path):
    """A real 64 KiB tmpfs that fills during the run (with --allow-partial, or where the start's
    projection fits but the files' blocks do not): exit 3, every file on it whole and verified, what is
    done and the resume command named; then, the volume grown, resumed to the same bytes as a run that
    never ran short."""
    data, reference = gen_run
    d = tmpfs("small", size="64k")
    out = d / "gen"
    stopped = hsx(*_args(data, out, "--allow-partial"), env=ENV, check=False)
    err = " ".join(stopped.stderr.split())
    assert "is under the reserve of" in err or "no space left on the output volume" in err, err
    done, resume = stopped_cleanly(stopped, out, CONVS, "conversations")
    assert resume == f"hsx generate --out {out}"

    remount(d, size="1m")
    resumed = hsx("generate", "--out", out, env=ENV)
    assert (
        f"{CONVS - done} written now (0 of them rejected, 0 ended early), {done} were already verified"
        in resumed.stdout
    )
    assert run_files(out) == run_files(reference)
    assert (out / "rejects.jsonl").read_bytes() == (reference / "rejects.jsonl").read_bytes()


def test_generate_export_prints_its_result_on_stdout(gen_run, tmp_path):
    dest = tmp_path / "e.jsonl"
    r = CliRunner().invoke(app, ["generate-export", str(gen_run[1]), str(dest)])
    assert r.exit_code == 0 and not r.stderr, r.output
    assert r.stdout.startswith(f"{CONVS} conversations to {dest} (") and "0 not generated left out" in r.stdout
    assert len(dest.read_text().splitlines()) == CONVS


def test_a_datasets_folder_split_limit_drop_and_threads(tmp_path, one_thread):
    """--data a save_to_disk folder with --split and --limit 3: the first 3 rows only, recorded in the
    spec (a resume asking for another limit is refused); --drop length rejects each conversation at
    its first answer cut by the length limit, with that reason; --threads sets torch's threads."""
    from hsx.genrun.record import GeneratedTurn

    datasets = require("datasets")
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(conversations(5))}).save_to_disk(str(folder))
    out = tmp_path / "gen"
    torch.set_num_threads(2)
    opts = _opts(out, model=str(TINY), data=[folder], split="train", limit=3, drop=["length"], max_new_tokens=3)
    summary = generate(dataclasses.replace(opts, threads=1), log=lambda m: None)
    assert torch.get_num_threads() == 1
    records = _records(out)
    assert [r.source.row for r in records] == [0, 1, 2]
    for rec in records:
        cut = [t for t in rec.turns if t.finish_reason == "length"]
        assert rec.ok == (not cut)
        if cut:  # generation stopped there: the cut answer is the last one
            (t,) = cut
            assert rec.turns[-1].message == t.message
            assert rec.reason == f"turn {t.message}: the generated answer was cut at the length limit (--drop length)"
    assert summary.rejected_now == sum(not r.ok for r in records) > 0
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == sorted(r.reason for r in records if not r.ok)
    (data,) = json.loads((out / "hsx.json").read_text())["data"]
    assert (data["split"], data["limit"]) == ("train", 3)
    assert json.loads((out / "hsx.json").read_text())["drop"] == ["length"]
    with pytest.raises(Refused, match="content, order, split or limit"):
        generate(dataclasses.replace(opts, limit=4), log=lambda m: None)

    from hsx.generate.job import dropped

    empty = GeneratedTurn(3, np.zeros(1, np.int32), np.zeros(1, np.int32), "stop", " \n")
    assert dropped(empty, ["empty"]) == "turn 3: the generated answer is empty (--drop empty)"
    assert dropped(empty, ["length"]) is None and dropped(empty, []) is None


def test_status_counts_the_rows_planning_rejected_and_generate_export_refuses_a_folder(gen_run, tmp_path):
    """Counts and words: a generate run's status counts the rows its planning rejected (it said
    "0 rejected" while rejects.jsonl held them); generate-export onto a folder is refused by name
    (it was a traceback), and writes nothing there."""
    _, out = gen_run
    r = CliRunner().invoke(app, ["status", str(out)])
    assert r.exit_code == 0 and "rejected: 2 input rows at planning; each with its reason in" in r.output, r.output
    folder = tmp_path / "existing"
    folder.mkdir()
    r = CliRunner().invoke(app, ["generate-export", str(out), str(folder)])
    assert r.exit_code == 2 and not isinstance(r.exception, IsADirectoryError), r.output
    assert f"{folder} is a folder: name the JSONL file to write" in r.output and not list(folder.iterdir())
