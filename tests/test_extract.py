"""The extraction job end to end: outputs against the reference, resume, drift, rejects, clear errors."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY, conversations, hsx, load_states, run_files, unwrite, write_jsonl
from hsx import target
from hsx.assess.verify import verify
from hsx.extract import ExtractOptions, Refused, extract
from hsx.store import layout


def _opts(out, data=None, **kw):
    base = dict(model=str(TINY), data=[data] if data else [], shard_size=10, batch_tokens=1024, device="cpu")
    if data is None:
        base.update(model=None)
    return ExtractOptions(out=out, **(base | kw))


@pytest.mark.parametrize("packing", ["off", "on"])
def test_written_files_equal_transformers_reference(tmp_path, convs, packing):
    out = tmp_path / "run"
    summary = extract(_opts(out, convs, layers=[0, 2, 5], packing=packing), log=lambda m: None)
    assert summary.complete and summary.written == 40
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    for sid in (0, 17, 39):
        t = load_states(layout.sample_path(out, sid, 10))
        with torch.no_grad():
            ref = model(t["input_ids"][None], output_hidden_states=True).hidden_states
        for j, k in enumerate([0, 2, 5]):
            assert (t["aux_hidden_states"][:, j * 64 : (j + 1) * 64] - ref[k + 1][0]).abs().max() <= 1e-5
        assert (t["hidden_states"] - ref[-1][0]).abs().max() <= 1e-5
        assert t["loss_mask"].dtype == torch.uint8 and t["loss_mask"].sum() > 0
    assert sorted(os.listdir(out / "shards")) == ["000000", "000001", "000002", "000003"]
    assert all((layout.shard_dir(out, s) / layout.SEALED).exists() for s in range(4))
    spec = json.loads((out / "hsx.json").read_text())
    assert spec["layers"] == [0, 2, 5] and spec["plan"]["num_samples"] == 40 and spec["dtype"] == "float32"
    assert spec["packed"] == (packing == "on")


def test_resume_redoes_exactly_the_damaged_samples(tmp_path, convs):
    out = tmp_path / "run"
    extract(_opts(out, convs), log=lambda m: None)
    clean = run_files(out)
    damaged = {3: "truncate", 14: "flip", 25: "zero", 31: "delete"}
    for sid, how in damaged.items():
        path = layout.sample_path(out, sid, 10)
        data = bytearray(path.read_bytes())
        if how == "truncate":
            path.write_bytes(bytes(data[: len(data) // 2]))
        elif how == "flip":
            data[-5] ^= 0x10
            path.write_bytes(bytes(data))
        elif how == "zero":
            path.write_bytes(b"\0" * len(data))
        else:
            path.unlink()
    stray = layout.shard_dir(out, 1) / ".000000011.safetensors.tmp-99-1"
    stray.write_bytes(b"half a file")
    before = {p: os.stat(p).st_ino for p in (out / "shards").rglob("*.safetensors")}
    summary = extract(_opts(out), log=lambda m: None)
    assert summary.written == 4 and summary.already_done == 36 and summary.stray_removed == 1
    assert summary.redone == {"corrupt": 2, "truncated": 1, "missing": 1}  # 31 was deleted from its sealed shard
    assert not stray.exists()
    assert run_files(out) == clean  # byte-identical
    redone = {layout.sample_path(out, s, 10) for s in damaged}
    for p, ino in before.items():
        if p not in redone:
            assert os.stat(p).st_ino == ino, f"{p} was rewritten"
    again = extract(_opts(out), log=lambda m: None)
    assert again.written == 0 and again.complete


def test_compiled_layers_equal_reference_and_a_fresh_compile_redoes_them_byte_identical(tmp_path, convs):
    """--compile on: the fused layers still equal transformers' own states, and a resume in a new
    process that compiles again from nothing (no compile cache) writes the same bytes."""
    out = tmp_path / "run"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    extract(_opts(out, convs, packing="on", compile="on"), log=lambda m: None)
    assert json.loads((out / "hsx.json").read_text())["compiled"] is True
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the layers really were compiled
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    for sid in (0, 21, 39):
        t = load_states(layout.sample_path(out, sid, 10))
        with torch.no_grad():
            ref = model(t["input_ids"][None], output_hidden_states=True).hidden_states
        # fused float32 kernels sum in another order than eager: equal to rounding, not bit for bit
        assert (t["aux_hidden_states"][:, 64:128] - ref[4][0]).abs().max() <= 1e-4
        assert (t["hidden_states"] - ref[-1][0]).abs().max() <= 1e-4
    clean = run_files(out)
    for sid in (2, 21, 33):
        layout.sample_path(out, sid, 10).unlink()
    hsx("extract", "--out", out, env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})  # compiles from nothing
    assert run_files(out) == clean
    asked_otherwise = ((dict(compile="off"), "compiled: run has True"), (dict(packing="off"), "packed: run has True"))
    for flags, named in asked_otherwise:
        with pytest.raises(Refused, match=named):  # an explicit setting that differs is refused, not ignored
            extract(_opts(out, **flags), log=lambda m: None)


def test_a_run_held_back_by_its_writes_says_how_long_it_waited(tmp_path, convs):
    """One sample in flight at a time: every capture waits for the previous file to be on disk,
    and the summary, metrics.json, the history's last line and the Prometheus textfile say how
    long the model stood still for the writes."""
    from prometheus_client.parser import text_string_to_metric_families

    from hsx.spec import load_spec
    from hsx.telemetry import read_history

    out, prom = tmp_path / "run", tmp_path / "hsx.prom"
    summary = extract(_opts(out, convs, writers=1, max_inflight_bytes=1, metrics_textfile=prom), log=lambda m: None)
    assert summary.complete and 0 < summary.waited_for_disk < summary.seconds
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["waited_for_disk_s"] == pytest.approx(summary.waited_for_disk, abs=0.5)
    total = load_spec(out).plan.num_tokens
    last = read_history(out)[-1]  # the session's final beat always adds a line
    assert last.tokens_done == total and last.waited_for_disk_s == metrics["waited_for_disk_s"]
    exposed = {s.name: s.value for f in text_string_to_metric_families(prom.read_text()) for s in f.samples}
    assert exposed["hsx_tokens_done"] == exposed["hsx_tokens_total"] == total
    assert exposed["hsx_waited_for_disk_seconds"] == metrics["waited_for_disk_s"]


def test_resume_with_other_settings_is_refused_naming_the_difference(tmp_path, convs):
    out = tmp_path / "run"
    extract(_opts(out, convs, layers=[1, 3]), log=lambda m: None)
    with pytest.raises(Refused, match=r"layers: run has \[1, 3\], asked for \[1, 4\]"):
        extract(_opts(out, layers=[1, 4]), log=lambda m: None)
    other = write_jsonl(tmp_path / "other.jsonl", conversations(40, start=200))
    with pytest.raises(Refused, match=r"data: .*other\.jsonl differ"):
        extract(_opts(out, other), log=lambda m: None)
    changed = tmp_path / "model"  # same architecture, shapes, tokenizer and file size; other weights
    torch.manual_seed(1)
    retrained = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(TINY).config)
    retrained.save_pretrained(changed)
    for f in TINY.iterdir():
        if not (changed / f.name).exists():
            (changed / f.name).write_bytes(f.read_bytes())
    assert (changed / "model.safetensors").stat().st_size == (TINY / "model.safetensors").stat().st_size
    with pytest.raises(Refused, match=r"model is not the run's model:\n  - model\.safetensors: content differs"):
        extract(_opts(out, model=str(changed)), log=lambda m: None)
    with pytest.raises(Refused, match="max length: run has 4096, asked for 128"):
        extract(_opts(out, max_length=128), log=lambda m: None)

    # A run made before hsx recorded its model's files: the other model is refused by its fingerprint,
    # and nothing is recorded of it (its files once were, and then the run's own model was refused).
    (out / layout.MODEL_FILES).unlink()
    older = json.loads((out / layout.SPEC).read_text())
    assert older.pop("model_files") is True  # a run that keeps one says so: without it, missing is damage
    (out / layout.SPEC).write_text(json.dumps(older))
    unwrite(out, 1)  # work for the resume
    with pytest.raises(Refused, match=r"model is not the run's model:\n  - model\.safetensors: content differs"):
        extract(_opts(out, model=str(changed)), log=lambda m: None)
    assert not (out / layout.MODEL_FILES).exists()
    with pytest.raises(Refused, match=r"model is not the run's model"):
        verify(out, fidelity_files=1, model=str(changed))
    resumed = extract(_opts(out, model=str(TINY)), log=lambda m: None)
    assert resumed.complete and resumed.written == 10
    from hsx.spec import load_spec

    weights = target.files_record(out, load_spec(out)).files["model.safetensors"]  # the run's own model's, as it stands
    assert weights.inode == (TINY / "model.safetensors").stat().st_ino != (changed / "model.safetensors").stat().st_ino


def test_a_run_on_the_fp8_route_resumes_only_under_the_quantization_it_began_with(tmp_path, convs):
    """The spec records how the fp8 route quantizes activations; a run begun under another (a
    run made before hsx recorded it: compiled torch code, other roundings) is refused by name before
    anything is written, where a resume would mix the two. Runs off the route record nothing."""
    from hsx.extract import folder
    from hsx.spec import FP8_ACTIVATIONS, load_spec

    out = tmp_path / "run"
    extract(_opts(out, convs), log=lambda m: None)
    spec = json.loads((out / layout.SPEC).read_text())
    assert "fp8_activations" not in spec and spec["quantized_compute"] is None
    unwrite(out, 1)
    for began, named in ((None, "compiled torch code"), ("triton-kernel/0", "triton-kernel/0")):
        recorded = {"quantized_compute": "fp8"} | ({} if began is None else {"fp8_activations": began})
        (out / layout.SPEC).write_text(json.dumps(spec | recorded))
        with pytest.raises(Refused, match=f"activations quantized by {named}.*this hsx quantizes them with "):
            extract(_opts(out), log=lambda m: None)
        assert not layout.shard_dir(out, 1).exists()
    (out / layout.SPEC).write_text(json.dumps(spec | {"quantized_compute": "fp8", "fp8_activations": FP8_ACTIVATIONS}))
    folder.refuse_other_quantization(out, load_spec(out))  # its own quantization: nothing to refuse


def test_rejects_are_recorded_and_good_rows_extract(tmp_path):
    good = conversations(5)
    rows = [good[0], "{broken", {"foo": 1}, good[1], {"messages": [{"role": "user", "content": "q"}]}, good[2]]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "run"
    summary = extract(_opts(out, data), log=lambda m: None)
    assert summary.complete and summary.total_samples == 3 and summary.rejected == 3
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["file"]) for r in rejects] == [(1, str(data)), (2, str(data)), (4, str(data))]
    assert [r["reason"].split(":")[0] for r in rejects] == ["malformed JSON", "unknown schema", "no assistant turn"]


def test_cli_errors_are_clear_not_tracebacks(tmp_path, convs):
    missing = hsx("extract", "--model", tmp_path / "nope", "--data", convs, "--out", tmp_path / "a", check=False)
    assert missing.returncode == 2 and "no such model folder" in missing.stderr and "Traceback" not in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    unreadable = hsx("extract", "--model", TINY, "--data", bad, "--out", tmp_path / "b", check=False)
    assert unreadable.returncode == 2 and "not valid JSON" in unreadable.stderr
    foreign = tmp_path / "c"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    taken = hsx("extract", "--model", TINY, "--data", convs, "--out", foreign, check=False)
    assert taken.returncode == 2 and "not empty" in taken.stderr and "Traceback" not in taken.stderr
    no_run = hsx("extract", "--out", tmp_path / "d", check=False)
    assert no_run.returncode == 2 and "needs --model and --data" in no_run.stderr
    typo = hsx("extract", "--model", TINY, "--data", convs, "--out", tmp_path / "e", "--compile", "yes", check=False)
    assert typo.returncode == 2 and "--compile takes auto, on or off, not 'yes'" in typo.stderr
    assert not (tmp_path / "e").exists()  # refused before anything was written


def test_quickstart_runs_and_summarises(tmp_path):
    proc = hsx("quickstart", "--out", tmp_path / "qs")
    assert "500/500 done" in proc.stdout
    assert len(run_files(tmp_path / "qs")) == 500


def test_set_up_interrupted_by_a_kill_is_redone_cleanly(tmp_path, convs):
    out = tmp_path / "run"
    (out / "plan").mkdir(parents=True)
    (out / "plan" / ".plan.parquet.tmp-4242").write_bytes(b"PAR1 half a plan")
    (out / ".rejects.jsonl.tmp-4242-1").write_bytes(b"{")
    summary = extract(_opts(out, convs), log=lambda m: None)
    assert summary.complete
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_resume_needs_only_the_run_folder_and_refuses_a_damaged_plan(tmp_path, convs):
    out = tmp_path / "run"
    extract(_opts(out, convs), log=lambda m: None)
    clean = run_files(out)
    convs.unlink()  # the source data is gone: a resume must not need it
    layout.sample_path(out, 7, 10).unlink()
    summary = extract(_opts(out), log=lambda m: None)
    assert summary.written == 1 and run_files(out) == clean

    import pyarrow.parquet as pq

    plan_file = out / "plan" / "plan.parquet"
    table = pq.read_table(plan_file)
    ids = table.column("input_ids").to_pylist()
    ids[3] = ids[3][::-1]  # same length and tokens, other order: only the fingerprint can tell
    pq.write_table(table.set_column(0, "input_ids", [ids]), plan_file)
    with pytest.raises(Refused, match="does not match the run spec's fingerprint"):
        extract(_opts(out), log=lambda m: None)


def test_resume_with_another_chat_template_is_refused(tmp_path, convs):
    from hsx.tinymodel import LLAMA3_TEMPLATE

    out = tmp_path / "run"
    extract(_opts(out, convs), log=lambda m: None)
    other = tmp_path / "model"
    other.mkdir()
    for f in TINY.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    with pytest.raises(Refused, match="chat template differs"):
        extract(_opts(out, model=str(other)), log=lambda m: None)


# 16 conversations. HyperCLOVA X's template drops the reasoning of every turn before the last user or
# tool turn, so 8 turns with reasoning are extracted after their own prompt. DeepSeek-V3.1's official
# one renders no reasoning (14 turns', 1 inline) and no tools block, and takes the calls' arguments of
# its 8 rows with calls only as text.
MIXES = {
    "tool_chat_template_hyperclovax_seed_think_14b.jinja": (24, {"own_sample_turns": 8, "call_ids_given": 10}, [
        "8 assistant turns extracted in a sample after their own prompt",
    ]),
    "DeepSeek-V3.1/chat_template.jinja": (16, {
        "reasoning_unrendered": 14, "tools_unrendered": 8, "call_ids_given": 10, "text_arguments_rows": 8,
    }, [
        "14 assistant turns' reasoning the chat template does not render",
        "8 rows' tools the chat template does not render",
        "8 rows whose calls' arguments the chat template renders only as JSON text",
    ]),
}  # fmt: skip


@pytest.mark.parametrize("template", MIXES)
def test_a_mix_of_chat_reasoning_and_tool_rows_extracts_rejecting_only_broken_rows(tmp_path, template):
    """Rows shaped like the public chat, reasoning and function-calling datasets, on the tiny model
    with a tool-capable reasoning template and with DeepSeek-V3.1's official one: only the really
    broken rows are rejected, each with its reason; the spec and the summary say what the template
    rendered otherwise; the files hold the plan."""
    import shutil

    from hsx.plan import Plan

    model = shutil.copytree(TINY, tmp_path / "model")
    data = Path(__file__).parent / "data"
    shutil.copy(data / "templates" / template, model / "chat_template.jinja")
    num_samples, rendering, lines = MIXES[template]
    out, said = tmp_path / "run", []
    summary = extract(_opts(out, data / "agentic.jsonl", model=str(model)), log=said.append)
    assert summary.complete
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rejects] == [
        "broken-orphan-result", "broken-arguments", "broken-call-id", "broken-function-call", "broken-extra-result",
        "glaive-v2",
    ]  # fmt: skip
    assert all(r["reason"].startswith("turn ") for r in rejects[:-1])
    assert rejects[-1]["reason"].startswith("a glaive-function-calling-v2 transcript")
    spec = json.loads((out / "hsx.json").read_text())["plan"]
    assert spec["num_samples"] == num_samples and spec["rendering"] == rendering
    assert spec["ignored_fields"] == {"category": 2, "messages[].name": 1, "messages[].weight": 1, "subcategory": 1}
    for said_line in [*lines, "10 tool calls without an id in the data, given one"]:
        assert any(said_line in line for line in said), said_line
    assert any(line.startswith("plan: metadata fields no template reads") for line in said)
    plan = Plan(out)
    for sid in range(spec["num_samples"]):
        t = load_states(layout.sample_path(out, sid, 10))
        assert t["input_ids"].tolist() == plan.input_ids(sid).tolist()
        assert t["loss_mask"].tolist() == plan.loss_mask(sid).tolist()


def test_chat_template_kwargs_render_the_plan_are_recorded_and_a_resume_asking_others_is_refused(tmp_path):
    """Qwen3's real template told not to think: every prompt ends with the empty reasoning block it
    forces and the answers are masked after it, the row's reasoning counted; the spec records the
    arguments, the summary says them, a resume asking others is refused by name, and a generate run
    (rendered with its own) refuses them."""
    import shutil

    from transformers import AutoTokenizer

    from hsx.errors import InputError
    from hsx.plan import Plan

    model = shutil.copytree(TINY, tmp_path / "model")
    data = Path(__file__).parent / "data"
    shutil.copy(data / "templates" / "Qwen3.jinja", model / "chat_template.jinja")
    rows = [json.loads(line) for line in (data / "agentic.jsonl").read_text().splitlines()]
    chat = write_jsonl(tmp_path / "chat.jsonl", [r for r in rows if r["id"] in ("reason-thinking", "story")])
    out, said, kwargs = tmp_path / "run", [], {"enable_thinking": False}
    assert extract(_opts(out, chat, model=str(model), template_kwargs=kwargs), log=said.append).complete
    spec = json.loads((out / "hsx.json").read_text())
    assert (
        spec["template_kwargs"] == kwargs and 'plan: the chat template\'s arguments: {"enable_thinking": false}' in said
    )
    assert spec["plan"]["rendering"]["reasoning_unrendered"] == 3  # the two of the story, the one of the answer
    tok, plan = AutoTokenizer.from_pretrained(model), Plan(out)
    for sid in range(len(plan)):
        ids, mask = plan.input_ids(sid), plan.loss_mask(sid)
        before = tok.decode(ids[: int(np.argmax(mask))].tolist())
        assert before.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(Refused, match=r"template kwargs: run has \{'enable_thinking': False\}, asked for \{\}"):
        extract(_opts(out, template_kwargs={}), log=lambda m: None)
    generated = tmp_path / "gen"
    generated.mkdir()
    (generated / "hsx.json").write_text(json.dumps({"kind": "generate"}))
    with pytest.raises(InputError, match="--chat-template-kwargs renders data files and datasets"):
        extract(_opts(tmp_path / "x", generated, template_kwargs=kwargs), log=lambda m: None)


def test_one_value_given_from_python_where_a_list_is_taken_is_refused_by_name(tmp_path):
    """``ExtractOptions(consumer="ab")`` was read letter by letter, a window waiting for consumers
    ``a`` and ``b``; ``data="x.jsonl"`` as files ``x``, ``.``, ... Both are refused by name; one
    value alone where the option takes one (``layers="eagle3"``) is not."""
    data = write_jsonl(tmp_path / "c.jsonl", conversations(2))
    out = tmp_path / "run"
    with pytest.raises(Refused, match="--consumer takes a list of values, not the one 'ab'"):
        _opts(out, data, window=1.0, consumer="ab")
    with pytest.raises(Refused, match="--data takes a list of values, not the one"):
        ExtractOptions(out=out, model=str(TINY), data=str(data))
    asked = _opts(out, data, layers="eagle3", window=1.0, consumer=["ab"]).window_asked()
    assert asked is not None and asked.consumers == ["ab"] and not out.exists()
