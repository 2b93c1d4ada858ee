"""The house's shape, checked: no import cycles among hsx's modules (imports inside functions
count too), and no lower stage imports a higher one."""

import ast
from pathlib import Path

import hsx

SRC = Path(hsx.__file__).parent
# a lower stage never imports these (the job's dispatcher, the command line, the training side, Ray)
LOWER = ("store", "spec", "plan", "target", "capture", "run", "errors", "finalnorm", "registry", "lock")
UPPER = ("scaleout", "export", "extract", "cli")


def _module(path: Path) -> str:
    parts = ["hsx", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """Every hsx module ``path`` imports, anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("hsx")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hsx"):
            for a in node.names:  # ``from hsx.store import layout`` imports the module hsx.store.layout
                sub = f"{node.module}.{a.name}"
                out.add(sub if _exists(sub) else node.module)
    return {m for m in out if _exists(m)}


def graph() -> dict[str, set[str]]:
    return {_module(p): imports_of(p) - {_module(p)} for p in SRC.rglob("*.py")}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    g = graph()
    assert len(g) > 40 and "hsx.job.prologue" in g["hsx.extract.local"]  # the walk sees the real tree
    assert cycles(g) == []


def test_lower_stages_never_import_upper_ones():
    def stage(mod: str) -> str:
        return mod.split(".")[1] if "." in mod else ""

    bad = [f"{m} -> {d}" for m, deps in graph().items() if stage(m) in LOWER for d in deps if stage(d) in UPPER]
    assert bad == []


def test_status_and_a_resume_with_nothing_to_do_never_load_torch(finished_run, tmp_path):
    """Seconds count for both on a run of tens of thousands of files: neither imports torch or
    transformers (several seconds on their own) when no model is needed."""
    import shutil
    import subprocess
    import sys

    run = str(shutil.copytree(finished_run, tmp_path / "run"))
    code = (
        "import sys; from typer.testing import CliRunner; from hsx.cli import app\n"
        f"r = CliRunner().invoke(app, ['status', {run!r}]); assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(app, ['extract', '--out', {run!r}]); assert r.exit_code == 0, r.output\n"
        "assert 'verified   40 files' in r.output and 'no model loaded' in r.output, r.output\n"
        "loaded = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
