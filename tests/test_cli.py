"""The command line as a new user meets it: every bad option refused by name, value and range before
anything is written; no traceback for a user's mistake; a failed start that says what it is; every
command hsx prints for the operator works when run as printed; help that shows what matters."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import pytest
import typer
from click.testing import CliRunner as ClickRunner
from typer.testing import CliRunner

from conftest import HANG_GUARD_S, SMALL_RUN, TINY, conversations, hsx, write_jsonl
from hsx.bench import BENCH
from hsx.bounds import Bound, Bounds
from hsx.cli import app
from hsx.cli.options import RUN, TO
from hsx.cli.output import print_summary
from hsx.errors import OptionError
from hsx.extract.memory import MEMORY
from hsx.extract.options import EXTRACT, ExtractOptions
from hsx.extract.summary import ExtractSummary
from hsx.store import layout


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output  # never a traceback
    return r.exit_code, r.output


def printed(pattern: str, text: str, verb: str = "extract") -> list[str]:
    """The command after ``pattern`` on its line, split as a shell would (a comment is left out)."""
    line = next(ln for ln in text.splitlines() if pattern in ln)
    args = shlex.split(line.split(pattern, 1)[1], comments=True)
    assert args[:2] == ["hsx", verb], line
    return args[1:]


@pytest.fixture
def convs(tmp_path) -> Path:
    return write_jsonl(tmp_path / "convs.jsonl", conversations(12))


# ---------------------------------------------------------------- 1: bounds, refused before anything is written

BAD = [
    (("--shard-size", "-1"), "--shard-size takes an integer >= 1 and <= 1000000, not -1"),
    (("--shard-size", "0"), "--shard-size takes an integer >= 1 and <= 1000000, not 0"),
    (("--max-length", "-5"), "--max-length takes an integer >= 1 and <= 100000000, not -5"),
    (("--max-length", "0"), "--max-length takes an integer >= 1 and <= 100000000, not 0"),
    (("--batch-tokens", "0"), "--batch-tokens takes an integer >= 1 and <= 100000000, not 0"),
    (("--writers", "0"), "--writers takes an integer >= 1 and <= 1024, not 0"),
    (("--tensor-parallel", "0"), "--tensor-parallel takes an integer >= 1 and <= 1024, not 0"),
    (("--expert-parallel", "-2"), "--expert-parallel takes an integer >= 1 and <= 1024, not -2"),
    (("--workers", "-1"), "--workers takes an integer >= 0 and <= 100000, not -1"),
    (("--metrics-port", "70000"), "--metrics-port takes an integer >= 1 and <= 65535, not 70000"),
    (("--dtype", "bf16"), "--dtype takes auto, bfloat16, float16 or float32, not 'bf16'"),
    (("--codec", "gzip"), "--codec takes raw, zstd or fp8, not 'gzip'"),
    (("--backend", "sglang"), "--backend takes transformers or vllm, not 'sglang'"),
    (("--packing", "yes"), "--packing takes auto, on or off, not 'yes'"),
]


@pytest.mark.parametrize(("bad", "said"), BAD, ids=[" ".join(b) for b, _ in BAD])
def test_extract_refuses_an_option_out_of_range_before_anything_is_written(tmp_path, convs, bad, said):
    code, out = cli("extract", "--model", TINY, "--data", convs, "--out", tmp_path / "run", *bad)
    assert code == 2 and said in out, out
    assert not (tmp_path / "run").exists()
    name = bad[0][2:].replace("-", "_")
    value = int(bad[1]) if bad[1].lstrip("-").isdigit() else bad[1]
    with pytest.raises(OptionError, match=re.escape(said)):  # the Python API: the same refusal
        ExtractOptions(out=tmp_path / "run", **{name: value})


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("status", "RUN", "--threads", "0"), "--threads takes an integer >= 1 and <= 1024, not 0"),
        (("verify", "RUN", "--threads", "-1"), "--threads takes an integer >= 1 and <= 1024, not -1"),
        (("vocab", "RUN", "--size", "0"), "--size takes an integer >= 1 and <= 10000000, not 0"),
        (
            ("export", "RUN", "DEST", "--to", "eagle"),
            "--to takes specforge, speculators, modelopt, deepspec or automodel, not 'eagle'",
        ),
        (("export", "RUN", "DEST", "--to", "specforge", "--draft-vocab", "0"), "--draft-vocab takes an integer >= 1"),
        (("bench", "--samples", "0"), "--samples takes an integer >= 1 and <= 10000000, not 0"),
        (("bench", "--compile", "yes"), "--compile takes auto, on or off, not 'yes'"),
        (
            ("memory", "--model", "RUN", "--tensor-parallel", "0"),
            "--tensor-parallel takes an integer >= 1 and <= 1024, not 0",
        ),
        (
            ("memory", "--model", "RUN", "--gpu-memory", "0"),
            "--gpu-memory takes a number > 0.0 and <= 100000.0, not 0.0",
        ),
        (("memory", "--model", "RUN", "--experts", "fp4"), "--experts takes auto, packed or dequantized, not 'fp4'"),
        (("generate", "--out", "DEST", "--top-k", "-1"), "--top-k takes an integer >= 0 and <= 10000000, not -1"),
    ],
)
def test_other_commands_refuse_options_out_of_range(tmp_path, args, said):
    args = [str(tmp_path / a) if a in ("RUN", "DEST") else a for a in args]
    code, out = cli(*args)
    assert code == 2 and said in out, out
    assert not (tmp_path / "DEST").exists()


def test_choices_are_the_ones_the_stages_accept():
    from hsx.capture.transformers import DTYPES
    from hsx.export import FORMATS
    from hsx.generate.engines import ENGINES
    from hsx.generate.options import GENERATE
    from hsx.store.codec import Codec

    assert set(EXTRACT.bounds["dtype"].choices) == {"auto", *DTYPES}
    assert set(EXTRACT.bounds["codec"].choices) == set(Codec)
    assert set(TO.bounds["to"].choices) == set(FORMATS)
    assert BENCH.bounds["compile"] is EXTRACT.bounds["compile"] and RUN.bounds["threads"].min == 1
    assert set(GENERATE.bounds["backend"].choices) == set(ENGINES)
    assert GENERATE.bounds["dtype"] is EXTRACT.bounds["dtype"]
    assert set(MEMORY.bounds["dtype"].choices) == set(DTYPES)


SAMPLING = Bounds(top_p=Bound(min=0.0, max=1.0, min_open=True), top_k=Bound(min=1), temperature=Bound(min=0.0))


def test_a_new_commands_bounds_are_declared_once_for_its_parser_and_its_api():
    """How a later command (sampling options, say) reuses the mechanism: one ``Bounds``, read by
    the parser (help and refusal) and by its options object (the same refusal, an OptionError)."""
    import typer

    sampling = SAMPLING
    app = typer.Typer(rich_markup_mode=None)  # as hsx's own

    @app.command()
    def generate(
        top_p: Annotated[float, SAMPLING.option("top_p", help="Nucleus mass.")] = 1.0,
        top_k: Annotated[int | None, SAMPLING.option("top_k", help="Candidates kept.")] = None,
    ) -> None:
        print(f"ok {top_p} {top_k}")

    runner = CliRunner()
    assert runner.invoke(app, ["--top-p", "1", "--top-k", "5"]).output.strip() == "ok 1.0 5"
    refused = runner.invoke(app, ["--top-p", "0"])
    assert refused.exit_code == 2 and "--top-p takes a number > 0.0 and <= 1.0, not 0.0" in refused.output
    assert "(a number > 0.0 and <= 1.0)" in " ".join(runner.invoke(app, ["--help"]).output.split())
    for values, said in (
        ({"top_p": 0.0}, "--top-p takes a number > 0.0"),
        ({"top_k": 2.5}, "--top-k takes an integer"),
    ):
        with pytest.raises(OptionError, match=re.escape(said)):
            sampling.check(SimpleNamespace(**({"top_p": 1.0, "top_k": None, "temperature": None} | values)))
    sampling.check(SimpleNamespace(top_p=1.0, top_k=40, temperature=0.0))  # within: no refusal


def test_the_same_data_file_twice_is_refused(tmp_path, convs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = cli("extract", "--model", TINY, "--data", convs, "--data", "./convs.jsonl", "--out", tmp_path / "run")
    assert code == 2 and f"--data names {convs} twice (also as convs.jsonl): give each file once" in out, out
    assert not (tmp_path / "run").exists()


def test_column_names_the_field_of_the_turns_and_a_resume_asking_another_is_refused_by_name(tmp_path):
    """A run read with --column records it; a resume naming another column (with its --data or
    without) or none is refused by name; a generate run as --data takes no --column."""
    rows = [{"id": r["id"], "dialog": r["conversations"]} for r in conversations(3)] + [{"id": "x", "chat": []}]
    data = write_jsonl(tmp_path / "dialogs.jsonl", rows)
    out = tmp_path / "run"
    code, said = cli("extract", "--model", TINY, "--data", data, "--out", out, "--column", "dialog", *SMALL_RUN)
    assert code == 0, said
    assert json.loads((out / layout.SPEC).read_text())["data"][0]["column"] == "dialog"
    (reject,) = [json.loads(line) for line in (out / layout.REJECTS).read_text().splitlines()]
    assert (reject["row"], reject["id"]) == (3, "x") and "no 'dialog' field, which --column dialog names" in reject[
        "reason"
    ]
    run = "data: the run read each row's turns from the column 'dialog' (--column dialog); asked for"
    for again, asked in (
        (["--data", data, "--column", "chat"], "the column 'chat' (--column chat)"),
        (["--column", "chat"], "the column 'chat' (--column chat)"),
        (["--data", data], "'conversations' or 'messages' (no --column)"),
    ):
        code, said = cli("extract", "--out", out, *again)
        assert code == 2 and f"{run} {asked}" in " ".join(said.split()), said
    code, said = cli("extract", "--out", out, "--data", data, "--column", "dialog")  # the same: resumes
    assert code == 0, said
    for again, asked in ((["--limit", "2"], "limit (none given); asked for --limit 2"), (["--split", "test"], "split")):
        code, said = cli("extract", "--out", out, *again)  # a row selection alone is checked too, never ignored
        assert code == 2 and f"data: the run read {asked}" in " ".join(said.split()), said

    generated = tmp_path / "generated"  # what extract knows a generate run by: its spec's kind
    generated.mkdir()
    (generated / layout.SPEC).write_text(json.dumps({"kind": "generate"}))
    code, said = cli("extract", "--model", TINY, "--data", generated, "--out", tmp_path / "x", "--column", "dialog")
    said = " ".join(said.split())
    assert (
        code == 2 and "--split, --limit and --column select rows of files and datasets, not of a generate run" in said
    )
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- 4: a user's mistake is a refusal, never a traceback


def test_out_naming_a_file_is_refused_by_every_command(tmp_path, convs):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    code, out = cli("extract", "--model", TINY, "--data", convs, "--out", f)
    assert code == 2 and f"--out {f} is a file, not a run folder" in out, out
    for args in (["status", f], ["verify", f], ["export", f, tmp_path / "dest", "--to", "speculators"], ["vocab", f]):
        code, out = cli(*args)
        assert code == 2 and "is a file" in " ".join(out.split()), out
    assert f.read_text() == "mine" and not (tmp_path / "dest").exists()


def test_a_device_this_machine_lacks_is_refused_before_the_run_folder(tmp_path, convs):
    proc = hsx(
        "extract", "--model", TINY, "--data", convs, "--out", tmp_path / "run", "--device", "cuda:99", check=False
    )
    assert proc.returncode == 2 and "error: --device cuda:99: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


KIMI_FP8 = Path(__file__).parent.parent / "bench" / "kimi-k2-fp8-shape"  # 64 heads, 64 KV heads, 384 experts
NO_VLLM = "needs vLLM, which is not installed here: pip install vllm"
NEW = ("--model", TINY, "--data", "DATA", "--out", "OUT")
REFUSED = [
    (("extract", *NEW, "--device", "tpu"), "--device takes cpu, cuda or cuda:N, not 'tpu'"),
    (("generate", *NEW, "--device", "tpu"), "--device takes cpu, cuda or cuda:N, not 'tpu'"),
    (("generate", *NEW, "--device", "mps"), "--device takes cpu, cuda or cuda:N, not 'mps'"),
    (("bench", "--device", "tpu"), "--device takes cpu, cuda or cuda:N, not 'tpu'"),
    (("extract", *NEW, "--device", "cuda"), "--device cuda: "),
    (("generate", *NEW, "--device", "cuda"), "--device cuda: "),
    (("bench", "--device", "cuda"), "--device cuda: "),
    (("extract", *NEW, "--backend", "vllm"), f"--backend vllm {NO_VLLM}"),
    (("generate", *NEW, "--backend", "vllm"), f"--backend vllm {NO_VLLM}"),
    (("bench", "--generate"), f"hsx bench --generate {NO_VLLM}"),
    (("generate", *NEW, "--samples-per-prompt", "2"), "--samples-per-prompt above 1 needs --temperature above 0"),
    (("generate", "--model", "OUT/nope", "--data", "DATA", "--out", "OUT"), "OUT/nope: no such model folder"),
    (("extract", "--model", "OUT/nope", "--data", "DATA", "--out", "OUT"), "OUT/nope: no such model folder"),
    (("generate", *NEW, "--drop", "empty,short"), "--drop takes empty, length (comma-separated), not 'short'"),
    (("generate", *NEW, "--split", "train"), "--split train applies to a Hugging Face dataset, not to a data file"),
    (
        ("extract", *NEW, "--column", "chat"),
        "no row has a column 'chat' (--column chat); its rows have: conversations, id",
    ),
    (
        ("generate", *NEW, "--column", "chat"),
        "no row has a column 'chat' (--column chat); its rows have: conversations, id",
    ),
    (("memory", "--model", KIMI_FP8, "--tensor-parallel", "16", "--gpus", "8"), "laid over 16 GPUs"),
    (("memory", "--model", KIMI_FP8, "--tensor-parallel", "7"), "num_attention_heads = 64 does not split over 7"),
    (
        ("memory", "--model", KIMI_FP8, "--tensor-parallel", "8", "--expert-parallel", "4"),
        "the expert-parallel size must be 1 or the tensor-parallel size (8), not 4",
    ),
    (("memory", "--model", TINY, "--tensor-parallel", "2"), "num_key_value_heads = 1 does not split over 2"),
    (("memory", "--model", TINY, "--pipeline-parallel", "9"), "9 pipeline stages need as many decoder layers"),
    (("extract", *NEW, "--window", "1e-12", "--consumer", "d"), "--window takes a number >= 1e-09"),  # was 0 B
    (("extract", *NEW, "--window-limit", "2"), "--window-limit needs --window: it is how far past the window"),
    (
        ("extract", *NEW, "--window", "2", "--consumer", "d", "--window-limit", "2"),
        "--window-limit 2 is not larger than --window 2: it is the larger bound (GB) up to which",
    ),
    (("extract", *NEW, "--window", "2", "--consumer", "d", "--window-limit", "1.5"), "--window-limit 1.5 is not"),
    (
        ("extract", *NEW, "--window", "2", "--consumer", "d", "--window-limit", "3TB"),
        "Invalid value for '--window-limit': Input should be a valid number",
    ),
    (("extract", *NEW, "--window", "2", "--consumer", "d", "--window-limit", "0"), "--window-limit takes a number >="),
    (("memory", "--model", TINY, "--interconnect", "pcie"), "--interconnect pcie says what joins GPUs whose"),
    (
        ("memory", "--model", TINY, "--tensor-parallel", "1", "--allreduce-gbps", "22"),
        "--allreduce-gbps judge which layout to run where none is given",
    ),
    (
        ("extract", *NEW, "--pipeline-parallel", "9"),
        "cannot lay the model over tensor 1, expert 1, pipeline 9: 9 pipeline stages need as many decoder layers, "
        "and the model has 8",
    ),
    (("extract", *NEW, "--pipeline-parallel", "2", "--workers", "2"), "--workers runs workers of one GPU or of a"),
]


@pytest.mark.parametrize(("args", "said"), REFUSED, ids=[" ".join(map(str, a[:1] + a[-2:])) for a, _ in REFUSED])
def test_device_backend_and_option_errors_are_refused_with_exit_2_before_anything_is_written(tmp_path, args, said):
    """Every command: a refusal by name (no traceback), and no folder made. The same layout checks
    in ``hsx memory`` as in an extraction (``run.options.resolve_parallel``, ``check_gpus``)."""
    import importlib.util

    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if "vllm" in said and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    out = tmp_path / "out"
    args = [str(out / a[4:]) if str(a).startswith("OUT/") else a for a in args]
    args = [{"DATA": data, "OUT": out}.get(a, a) if isinstance(a, str) else a for a in args]
    code, text = cli(*args)
    said = said.replace("OUT/", f"{out}/")
    assert code == 2 and said in " ".join(text.split()), text
    assert not out.exists()


# ---------------------------------------------------------------- 5 and 6: failed starts, printed commands


@pytest.mark.parametrize("case", ["not json", "max-length 1", "empty"])
def test_a_start_with_no_usable_row_writes_its_rejects_and_says_what_it_is(tmp_path, case):
    data = tmp_path / "data.jsonl"
    extra: list[str] = []
    if case == "not json":
        data.write_text("this is not JSON\n{oops\n")
    elif case == "max-length 1":
        write_jsonl(data, conversations(3))
        extra = ["--max-length", "1"]
    else:
        data.write_text("")
    out = tmp_path / "run"
    code, said = cli("extract", "--model", TINY, "--data", data, "--out", out, "--device", "cpu", *extra)
    said = " ".join(said.split())
    assert code == 2 and "no usable samples" in said and "no run was made" in said, said
    rejects = [json.loads(line) for line in (out / layout.REJECTS).read_text().splitlines()]
    if case == "empty":
        assert rejects == [] and "the data holds no rows" in said
    else:
        assert len(rejects) == {"not json": 2, "max-length 1": 3}[case] and f"see {out / layout.REJECTS}" in said
        assert all(r["reason"] for r in rejects)
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]  # no half-written plan left behind
    assert not (out / layout.SPEC).exists()
    if case != "max-length 1":
        return
    # what status says of the folder, and the command it prints, run as printed: refused for the reason stated
    status = hsx("status", out, check=False)
    assert status.returncode == 2 and "not a run: a start that never became one (no usable samples" in status.stdout
    assert "restore" not in status.stdout, status.stdout
    again = printed("start it again: ", status.stdout)
    assert again[again.index("--max-length") + 1] == "1"
    rerun = hsx(*again, check=False)
    assert rerun.returncode == 2 and "no usable samples: all 3 rows were rejected" in rerun.stderr, rerun.stderr


def test_ctrl_c_before_the_spec_prints_the_command_that_starts_it_and_that_command_works(tmp_path):
    slow = {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": f"turn {i}"} for i in range(350)]}
    data = write_jsonl(tmp_path / "slow.jsonl", [slow, slow, *conversations(3)])  # a few seconds to plan
    out = tmp_path / "run"
    args = ["extract", "--model", TINY, "--data", data, "--out", out, *SMALL_RUN, "--max-length", "64"]
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx", *map(str, args)],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | env,
    )
    for line in proc.stderr:  # planning has begun: the spec is written only after it
        if line.startswith("planning"):
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=HANG_GUARD_S) == 130, rest
    assert not (out / layout.SPEC).exists(), "the plan finished before the Ctrl-C: make the data slower to plan"
    assert "resume with" not in rest and "no run was made; start it again with: " in rest, rest
    again = printed("start it again with: ", rest)
    assert again[again.index("--max-length") + 1] == "64" and "--shard-size" in again
    done = hsx(*again)
    assert "5/5 done" in done.stdout, done.stdout


def _interrupt(args: list, ready: str | Callable[[], bool]) -> str:
    """Start ``hsx ARGS``, send a Ctrl-C once a line of its stderr starts with ``ready`` (or once
    ``ready()`` holds); its stderr after it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx", *map(str, args)],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    if isinstance(ready, str):
        next(line for line in proc.stderr if line.startswith(ready))
    else:
        deadline = time.monotonic() + HANG_GUARD_S
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=HANG_GUARD_S) == 130, rest
    return rest


def test_generate_ctrl_c_before_and_after_the_spec_prints_a_command_that_works(tmp_path):
    slow = {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": f"turn {i}"} for i in range(500)]}
    data = write_jsonl(tmp_path / "slow.jsonl", [slow, slow, *conversations(16)])  # a few seconds to plan
    out = tmp_path / "gen"
    args = ["generate", "--model", TINY, "--data", data, "--out", out, "--device", "cpu", "--max-new-tokens", "12",
            "--max-length", "64", "--shard-size", "2", "--seed", "5", "--turns", "last"]  # fmt: skip
    rest = _interrupt(args, "planning")  # the spec is written only after the plan
    assert not (out / layout.SPEC).exists(), "the plan finished before the Ctrl-C: make the data slower to plan"
    assert "resume with" not in rest and "no run was made; start it again with: " in rest, rest
    again = printed("start it again with: ", rest, "generate")
    assert again[again.index("--max-length") + 1] == "64" and again[again.index("--seed") + 1] == "5"
    assert json.loads((out / layout.FAILED_START).read_text())["command"] == shlex.join(["hsx", *again])
    status = hsx("status", out, check=False)
    assert status.returncode == 2 and "a start that never became one (interrupted" in status.stdout, status.stdout
    # the printed command, run as printed, is the start; Ctrl-C it again once a conversation is written
    rest = _interrupt(again, lambda: any((out / "shards").rglob("*.safetensors")))
    assert (out / layout.SPEC).exists() and not (out / layout.FAILED_START).exists()
    assert f"resume with: hsx generate --out {out}" in rest, rest
    done = hsx(*printed("resume with: ", rest, "generate"))
    # --turns last: the long conversations are slow to plan, not to generate (one turn each)
    assert re.search(r"convs +(\d+)/\1 done, \d+ written now .*, [1-9]\d* were already verified", done.stdout), (
        done.stdout
    )


@pytest.fixture(scope="module")
def moved(tmp_path_factory) -> tuple[Path, Path]:
    """A finished 12-sample run whose model folder was then moved: (run, the model's new place)."""
    root = tmp_path_factory.mktemp("moved")
    shutil.copytree(TINY, root / "model")
    data = write_jsonl(root / "convs.jsonl", conversations(12))
    hsx("extract", "--model", root / "model", "--data", data, "--out", root / "run", *SMALL_RUN)
    (root / "model").rename(root / "model-new")
    return root / "run", root / "model-new"


def test_status_with_a_moved_model_prints_a_resume_that_works_as_printed(moved):
    run, new = moved
    (run / "shards" / "000000" / layout.sample_name(4)).unlink()  # one file gone from a sealed shard
    status = hsx("status", run, "--model", new, check=False)
    assert status.returncode == 1, status.stdout
    resume = printed("resume: ", status.stdout)
    assert resume[resume.index("--model") + 1] == str(new), resume
    done = hsx(*resume)
    # the summary is on stdout, and the redone line counts the file that was gone
    assert "12/12 done, 1 written now" in done.stdout and "redone     1 missing" in done.stdout, done.stdout
    assert "disk " not in done.stdout  # a run of seconds: no advice on the disk's pace
    assert hsx("status", run).returncode == 0


def test_the_command_verify_repair_prints_redoes_what_it_moved(finished_run, tmp_path):
    run = shutil.copytree(finished_run, tmp_path / "run")
    bad = layout.sample_path(run, 7, 10)
    bad.write_bytes(bad.read_bytes()[:100])
    repaired = hsx("verify", run, "--repair", check=False)
    assert repaired.returncode == 1 and "# redoes 1 samples" in repaired.stdout, repaired.stdout
    done = hsx(*printed("next: ", repaired.stdout))
    assert "40/40 done, 1 written now" in done.stdout and "redone     1 missing" in done.stdout, done.stdout


# ---------------------------------------------------------------- 7: help, version, flags; 8: the summary


# every command of the app, so a command added later is covered too
COMMANDS = [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]


def test_every_command_is_listed():
    assert {"extract", "status", "generate", "generate-export", "memory"} <= set(COMMANDS), COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_defaults_and_choices_and_fits_80_columns(command):
    r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert r.exit_code == 0, r.output
    assert all(len(line) <= 80 for line in r.output.splitlines()), r.output
    assert "<bool>" not in r.output
    assert " / --no-" not in r.output, r.output  # a switch is a flag that takes no value, with one spelling
    text = " ".join(r.output.split())
    expected = {
        "extract": [
            "--dtype [auto|bfloat16|float16|float32]",
            "[default: (4096)]",
            "--device DEVICE cpu, cuda or cuda:N. [default: (cuda if available)]",
            "(needs the hsx[ray] extra)",
            "--codec [raw|zstd|fp8]",
            "--backend [transformers|vllm]",
            "(an integer >= 1 and <= 1000000)",
        ],
        "status": ["--threads N", "[default: 8]"],
        "export": ["--to [specforge|speculators|modelopt|deepspec|automodel]", "[default: (the model's config)]"],
        "vocab": ["[default: (OUT/vocab)]", "[default: 32000]"],
        "bench": ["--compile [auto|on|off]", "[default: auto]"],
        "generate": [
            "--backend [transformers|vllm|server]",
            "--turns [all|last]",
            "--dtype [auto|bfloat16|float16|float32]",
            "(a number > 0.0 and <= 1.0)",
            "[default: (2048)]",
            "--fast-verify On resume",
        ],
        "generate-export": ["--allow-incomplete Export"],
        "memory": ["--experts [auto|packed|dequantized]", "[default: 16384]", "(a number > 0.0 and <= 100000.0)"],
    }.get(command, [])
    for piece in expected:
        assert piece in text, (piece, r.output)


def test_version_and_flags_that_take_no_value(tmp_path):
    from importlib.metadata import version

    code, out = cli("--version")
    assert code == 0 and out.strip() == f"hsx {version('hsx')}"
    code, out = cli("status", tmp_path, "--json", "true")
    assert code == 2 and "unexpected extra argument(s) (true)" in out, out


@pytest.mark.parametrize(
    ("seconds", "waited", "advice"), [(1.1, 0.1, False), (600.0, 20.0, False), (120.0, 30.0, True)]
)
def test_disk_advice_only_where_acting_on_it_would_matter(tmp_path, capsys, seconds, waited, advice):
    s = ExtractSummary(tmp_path, 10, written=10, seconds=seconds, total_tokens=100, tokens_written=100)
    s.waited_for_disk = waited
    print_summary(s)
    out = capsys.readouterr().out
    assert "10/10 done" in out
    assert ("a faster volume or more --writers" in out) is advice, out


# ---------------------------------------------------------------- 9: text printed as it is; results on stdout


def test_square_brackets_in_paths_and_messages_print_as_they_are(tmp_path, convs, finished_run, monkeypatch):
    """Console markup would eat ``[v2]`` and ``[ray]``: paths are named as they are, in errors, in
    progress lines and in the summary, and the refusal of --workers without Ray (a real environment
    without it: a ``ray`` that does not import) says ``pip install 'hsx[ray]'``."""
    monkeypatch.chdir(tmp_path)
    data = shutil.copy(convs, tmp_path / "convs[v2].jsonl")
    code, out = cli("extract", "--data", data, "--data", "./convs[v2].jsonl", "--out", tmp_path / "run")
    assert code == 2 and f"--data names {data} twice (also as convs[v2].jsonl)" in out, out
    run, model = tmp_path / "run[1]", tmp_path / "model[v2]"
    shutil.copytree(finished_run, run)
    shutil.copytree(TINY, model)
    r = CliRunner().invoke(app, ["extract", "--out", str(run), "--model", str(model)])
    assert r.exit_code == 0 and f"model: {model} matches the run's fingerprint" in r.stderr, r.output
    assert f"run        {run}  (complete)" in r.stdout, r.output
    no_ray = tmp_path / "no-ray"
    (no_ray / "ray").mkdir(parents=True)
    (no_ray / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    path = os.pathsep.join(p for p in (str(no_ray), os.environ.get("PYTHONPATH")) if p)
    proc = hsx("extract", "--out", tmp_path / "new", "--workers", "1", check=False, env={"PYTHONPATH": path})
    assert proc.returncode == 2 and proc.stderr.endswith("pip install 'hsx[ray]'\n"), proc.stderr


def test_results_go_to_stdout_and_progress_to_stderr(finished_run, tmp_path):
    """``hsx memory ... > plan.txt`` holds the plan (the shell's redirect: stdout alone)."""
    plan = tmp_path / "plan.txt"
    args = ["memory", "--model", str(TINY), "--gpus", "1", "--gpu-memory", "80"]
    with plan.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "hsx", *args], stdout=f, stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 0 and "memory per GPU" not in proc.stderr, proc.stderr
    said = plan.read_text()
    verdict, storage = said.split("storage per token", 1)  # the memory plan and its verdict, then each preset's bytes
    assert said.startswith("memory per GPU for TP1, ") and verdict.rstrip().endswith("fits"), said
    assert "--layers dflash:5: 5 taps" in storage, said
    r = CliRunner().invoke(app, ["vocab", str(finished_run), "--size", "48", "--dest", str(tmp_path / "vocab")])
    assert r.exit_code == 0 and r.stdout.startswith("vocab      48 of 2048 tokens") and not r.stderr, r.output


SPECIFIC = {
    "device": "cpu",
    "drop": ["length", "empty"],
    "consumer": ["draft-a", "draft-b"],
    "pipeline_parallel": 1,
    "plane": "mooncake://127.0.0.1:50051",
    "window_limit": 2.0,  # larger than --window (a float field's 0.5)
}


def _values_not_default(cls, bounds: Bounds, tmp_path: Path) -> dict:
    """A value other than its default for every field of ``cls`` that has an option, within its bound."""
    from dataclasses import fields
    from typing import get_type_hints

    from hsx.job.options import NOT_FLAGS

    values, hints = {}, get_type_hints(cls)
    for f in fields(cls):
        hint, bound = str(hints[f.name]), bounds.bounds.get(f.name)
        if f.name in NOT_FLAGS:
            continue
        if f.name in SPECIFIC:
            values[f.name] = SPECIFIC[f.name]
        elif bound is not None and bound.choices:  # vllm is refused where it is not installed, as here
            values[f.name] = next(c for c in reversed(bound.choices) if c not in (f.default, "vllm"))
        elif hint == "<class 'bool'>":
            values[f.name] = not f.default
        else:
            by_type = {"list[pathlib.Path]": [tmp_path / "a.jsonl", tmp_path / "b.jsonl"], "list[int]": [1, 5],
                       "list[str]": ["http://127.0.0.1:1", "http://127.0.0.1:2"], "Path": tmp_path / f.name,
                       "dict": {"enable_thinking": False}, "int": 3, "float": 0.5, "str": "org/name"}  # fmt: skip
            values[f.name] = next(v for t, v in by_type.items() if t in hint)
    return values


@pytest.mark.parametrize("verb", ["extract", "generate"])
def test_every_field_of_a_jobs_options_is_an_option_and_a_printed_command_parses_back_to_it(
    tmp_path, monkeypatch, verb
):
    """The parser is made from the options dataclass, ``command_line`` writes a command back from
    it: every field given (none at its default) survives the round trip, so an option added to the
    dataclass is on the command line and in every command hsx prints."""
    from hsx.cli import jobs
    from hsx.generate.options import GENERATE, GenerateOptions

    cls, bounds = {"extract": (ExtractOptions, EXTRACT), "generate": (GenerateOptions, GENERATE)}[verb]
    # --plane is refused where the store's client does not import (tests/test_plane.py, in its own
    # environment): here only its place on the command line is the point
    monkeypatch.setattr("hsx.plane._store_module", lambda: None)
    given = cls(**_values_not_default(cls, bounds, tmp_path))
    built = []
    monkeypatch.setattr(jobs, "run_job", lambda verb, stage, out, model, build: built.append(build()))
    code, out = cli(*shlex.split(given.command())[1:])
    assert code == 0 and built == [given], out


# ---------------------------------------------------------------- hostile values: every option field, every command

HOSTILE_NUMBERS = ("nan", "inf", "-inf", "9" * 40, "1e300", "-1", "")


def _hostile(hint: str, bound: Bound | None) -> tuple[str, ...]:
    """The values of a field's type that no option may take: for a number NaN, the infinities, one
    past any upper end, a negative and nothing; for a name or a path, nothing."""
    if bound is not None and bound.choices:
        return ("nan", "-1", "")
    if any(t in hint for t in ("int", "float")):
        return HOSTILE_NUMBERS
    return ("", " ")


def _hostile_cases(tmp_path: Path, convs: Path) -> list[tuple[str, ...]]:
    from dataclasses import fields
    from typing import get_type_hints

    from hsx.generate.options import GENERATE, GenerateOptions
    from hsx.job.options import NOT_FLAGS, flag_name

    cases = []
    for verb, cls, bounds in (("extract", ExtractOptions, EXTRACT), ("generate", GenerateOptions, GENERATE)):
        hints = get_type_hints(cls)
        for f in fields(cls):
            hint = str(hints[f.name])
            if f.name in NOT_FLAGS or hint == "<class 'bool'>":  # a flag takes no value
                continue
            flag = flag_name(cls, f.name)
            base = {"--model": str(TINY), "--data": str(convs), "--out": str(tmp_path / "run")}
            for value in _hostile(hint, bounds.bounds.get(f.name)):
                args = base | {flag: value}
                cases.append((verb, *[x for k, v in args.items() for x in (k, v)]))
    for args, bounds in (
        (("status", "RUN"), RUN),
        (("vocab", "RUN"), RUN),
        (("export", "RUN", "DEST", "--to", "specforge"), TO),
        (("bench",), BENCH),
        (("memory", "--model", str(TINY)), MEMORY),
    ):
        for name, bound in bounds.bounds.items():
            flag = Bounds.flag(name)
            if bound.choices or (name == "to" and args[0] == "export") or (name == "size" and args[0] == "status"):
                continue
            if (args[0], name) in (("status", "size"), ("status", "draft_vocab"), ("status", "target_vocab")):
                continue
            cases += [(*args, flag, v) for v in HOSTILE_NUMBERS]
    return cases


def test_every_option_refuses_hostile_values_with_exit_2_and_writes_nothing(tmp_path, monkeypatch):
    """The property, over every field of the job commands' options and every number of the other
    commands: NaN, the infinities, a number past any upper end, a negative and an empty value are
    each refused (exit 2, never a traceback) before anything is written, anywhere."""
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "keep.txt").write_text("an --out '' is this folder, which is not empty")
    monkeypatch.chdir(work)
    convs = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    cases = _hostile_cases(tmp_path, convs)
    command, runner = typer.main.get_command(app), ClickRunner()  # made once: typer's runner makes it per call
    wrong = []
    for args in cases:
        r = runner.invoke(command, list(args))
        if r.exit_code != 2 or not isinstance(r.exception, SystemExit):
            wrong.append(f"{' '.join(args[:1] + args[-2:])} -> exit {r.exit_code}: {r.output.strip()[-200:]}")
    assert not wrong, "\n".join(wrong)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert len(cases) > 400  # every field of both options classes, every number of the rest


def test_a_value_json_cannot_hold_never_reaches_a_spec(tmp_path):
    """The real command: ``--temperature nan`` ran to exit 0 and wrote ``"temperature": null`` into
    the spec, after which status called hsx.json damaged and every resume refused. Now it is refused
    before anything is written, as is a value only JSON's NaN could carry in ``--chat-template-kwargs``."""
    convs = write_jsonl(tmp_path / "convs.jsonl", conversations(2))
    r = hsx(
        "generate", "--model", TINY, "--data", convs, "--out", tmp_path / "gen", "--temperature", "nan", check=False
    )
    assert r.returncode == 2 and "--temperature takes a number >= 0.0 and <= 100.0, not nan" in r.stderr, r.stderr
    assert not (tmp_path / "gen").exists() and "Traceback" not in r.stderr
    code, out = cli("generate", "--model", TINY, "--data", convs, "--out", tmp_path / "gen",
                    "--chat-template-kwargs", '{"budget": NaN}')  # fmt: skip
    assert code == 2 and "--chat-template-kwargs holds NaN or an infinity" in out and not (tmp_path / "gen").exists()


IGNORED = [
    (("generate", "--server", "http://127.0.0.1:1"), "--server applies to --backend server; this run generates with"),
    (("generate", "--server-timeout", "5"), "--server-timeout applies to --backend server"),
    (("generate", "--backend", "server"), "--backend server needs the servers to send requests to"),
    (("generate", "--backend", "server", "--server", "ftp://127.0.0.1/x"), "--server takes an http:// or https:// URL"),
    (("extract", "--allow-incomplete"), "this run's --data is not a generate run"),
    (("extract", "--metrics-textfile", "DIR"), "is a folder: name the file to keep"),
    (("extract", "--ray-address", "127.0.0.1:6379"), "--ray-address is where --workers run"),
    (("extract", "--data-parallel-size", "2"), "--data-parallel-size size vLLM's engine; this run's backend is"),
    (("extract", "--fidelity-floor", "0.9"), "--fidelity-floor holds a run whose data is this model's own"),
    (
        ("extract", "--chat-template-kwargs", '{"add_generation_prompt": true}'),
        "--chat-template-kwargs cannot set add_generation_prompt: hsx passes",
    ),
    (("extract", "--chat-template-kwargs", '{"tokenize": true}'), "--chat-template-kwargs cannot set tokenize"),
    (
        ("generate", "--chat-template-kwargs", '{"messages": [], "tools": [], "continue_final_message": true}'),
        "--chat-template-kwargs cannot set continue_final_message, messages, tools",
    ),
]


@pytest.mark.parametrize(("args", "said"), IGNORED, ids=[" ".join(a) for a, _ in IGNORED])
def test_an_option_the_run_would_ignore_is_refused_by_name_before_anything_is_written(tmp_path, convs, args, said):
    """Options accepted and then ignored (or refused only once the plan was written) are refused by
    name, exit 2, with nothing written."""
    verb, *rest = (str(tmp_path) if a == "DIR" else a for a in args)
    code, out = cli(verb, "--model", TINY, "--data", convs, "--out", tmp_path / "run", *rest)
    assert code == 2 and said in out, out
    assert not (tmp_path / "run").exists()


def test_an_out_that_cannot_be_written_is_refused_by_name_not_a_traceback(tmp_path, convs, tmpfs):
    """A read-only --out and an --out under a regular file were tracebacks; a folder given as
    --data was "no such data file"."""
    readonly = tmpfs("ro", size="1m")
    subprocess.run(["mount", "-o", "remount,ro", str(readonly)], check=True)
    for out, said in (
        (readonly / "run", f"{readonly} is not writable here (read-only, or not this user's)"),
        (convs / "run", f"{convs} is a file, not a folder"),
    ):
        code, text = cli("extract", "--model", TINY, "--data", convs, "--out", out)
        assert code == 2 and f"--out {out}: {said}" in text, text
    code, text = cli("extract", "--model", TINY, "--data", tmp_path, "--out", tmp_path / "run")
    assert code == 2 and f"{tmp_path} is a folder, not a data file nor a Hugging Face dataset saved" in text, text
    assert not (tmp_path / "run").exists()


def test_quickstart_refuses_an_out_that_is_a_file_by_name_not_a_traceback(tmp_path):
    """Its options were built before the refusals were caught: an ``--out`` that is a file was a traceback."""
    (tmp_path / "afile").write_text("not a run")
    r = CliRunner().invoke(app, ["quickstart", "--out", str(tmp_path / "afile")])
    assert r.exit_code == 2 and "is a file, not a run folder" in r.output, r.output
    assert (tmp_path / "afile").read_text() == "not a run"


def test_export_taps_that_are_no_layer_ids_are_refused_as_taps(tmp_path):
    """``--taps abc`` was refused in --layers' words (``--layers takes comma-separated layer ids or a
    draft preset``), naming an option the export does not have."""
    code, out = cli("export", tmp_path, tmp_path / "dest", "--to", "speculators", "--taps", "abc")
    said = " ".join(out.split())
    assert code == 2 and "Invalid value for --taps: takes comma-separated hsx layer ids, e.g. 1,9,17, not 'abc'" in said
    assert "--layers" not in out and not (tmp_path / "dest").exists()


def test_verify_fidelity_files_without_fidelity_is_refused_by_name(tmp_path):
    """``verify --fidelity-files 3`` without ``--fidelity`` recomputed nothing and said nothing of it."""
    code, out = cli("verify", tmp_path, "--fidelity-files", "3")
    assert code == 2 and "--fidelity-files: sizes the sample --fidelity recomputes: give --fidelity too" in out, out


def test_a_stop_that_comes_during_an_uninterrupted_block_is_raised_right_after_it():
    """hsx's SIGTERM and Ctrl-C handlers hold the stop while an ``uninterrupted`` block runs (a
    durable file's count): every statement of it runs, the stop comes before the next one, with its
    exit code. Real signals, sent to this process from inside the block."""
    from hsx.cli.output import failures
    from hsx.errors import uninterrupted

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    ran = []
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        with pytest.raises(typer.Exit) as stopped, failures(lambda: "resume with: ..."):
            with uninterrupted():
                os.kill(os.getpid(), sig)
                deadline = time.monotonic() + 0.2  # Python runs a handler between two statements: many here
                while time.monotonic() < deadline:
                    pass
                ran.append(sig)
            ran.append("after the block")
        assert stopped.value.exit_code == code
    assert ran == [signal.SIGTERM, signal.SIGINT]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # the handlers put back
