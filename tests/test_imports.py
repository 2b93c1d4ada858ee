"""The house's shape, checked: no import cycles among hsx's modules (imports inside functions
count too), nor among the packages and modules of any package, and every module imports only from
its own layer or those below it (``LAYERS``: by package, a package's ``__init__`` with it; the same
list as docs/DESIGN.md's house)."""

import ast
from pathlib import Path

import hsx
from conftest import HANG_GUARD_S

SRC = Path(hsx.__file__).parent
# lowest first: each package (or top-level module) by its name under hsx
LAYERS = [
    ("hsx", "errors", "units", "bounds", "drafts"),  # the vocabulary: errors, units, option bounds, draft types
    ("store",),  # the run folder's files: layout, durable writes, the file format, codecs, scans
    # run-folder services, input, the node's interconnect
    (
        "fingerprint",
        "lock",
        "registry",
        "consumer",
        "telemetry",
        "progress",
        "input",
        "hfdatasets",
        "interconnect",
        "launch",
    ),
    # what a run is: spec, model, plan; a generate run; where its samples also go (the data plane)
    ("spec", "target", "finalnorm", "plan", "tinymodel", "genrun", "plane"),
    # the target running: token ids in, states out (checked: fidelity, certify); the teacher's distribution
    ("capture", "staging", "fidelity", "certify", "teacher"),
    ("job",),  # what every job does around its work: options, folder steps, space, the resume prologue
    ("generate",),  # the generate stage
    ("extract",),  # the extraction stage and its executors (this process, a tensor-parallel group, Ray workers)
    ("assess", "export", "data"),  # status and verify, the trainers' exports, the training-side reader
    ("bench", "cli", "__main__"),  # benchmarks and the command line
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


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


def package(mod: str) -> str:
    """The package (or top-level module) under hsx that ``mod`` belongs to, its ``__init__`` included."""
    return mod.split(".")[1] if "." in mod else mod


def layer(mod: str) -> int:
    return LAYER[package(mod)]


def package_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between the parts of every package: its modules and subpackages, each taken whole (the
    package ``hsx.extract``'s parts are ``hsx.extract.local``, ``hsx.extract.workers``, ...; hsx's are
    its packages and top-level modules). A package's own ``__init__`` is the package itself."""
    found = []
    packages = {".".join(m.split(".")[:i]) for m in g for i in range(1, m.count(".") + 1)}
    for pkg in sorted(packages):
        depth = pkg.count(".") + 1

        def part(mod: str, pkg: str = pkg, depth: int = depth) -> str | None:
            if mod == pkg or not mod.startswith(pkg + "."):
                return None  # the package itself, or outside it
            return ".".join(mod.split(".")[: depth + 1])

        parts: dict[str, set[str]] = {}
        for m, deps in g.items():
            if (a := part(m)) is not None:
                parts.setdefault(a, set()).update(b for d in deps if (b := part(d)) is not None and b != a)
        found += cycles(parts)
    return found


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above its own, as ``module -> imported``."""
    return sorted(f"{m} -> {d}" for m, deps in g.items() for d in deps if layer(d) > layer(m))


def test_the_checker_finds_an_import_running_up():
    g = {"hsx.store.scan": {"hsx.errors", "hsx.job.space"}, "hsx.extract": {"hsx.extract.workers.driver"}}
    assert upward(g) == ["hsx.store.scan -> hsx.job.space"]
    assert upward({"hsx.extract.workers.driver": {"hsx.assess"}}) == ["hsx.extract.workers.driver -> hsx.assess"]
    assert upward({"hsx.extract": {"hsx.assess.status"}}) == ["hsx.extract -> hsx.assess.status"]  # no special layer


def test_the_checker_finds_a_cycle_between_packages_where_modules_make_none():
    """``extract.local -> generate.job`` and ``generate.folder -> extract.options``: no module cycle,
    but the packages import each other; the same between a package's subpackage and its modules."""
    g = {
        "hsx.extract.local": {"hsx.generate.job"},
        "hsx.generate.job": set(),
        "hsx.generate.folder": {"hsx.extract.options"},
        "hsx.extract.options": set(),
    }
    assert cycles(g) == [] and package_cycles(g) == [["hsx.extract", "hsx.generate"]]
    inner = {"hsx.extract.workers.driver": {"hsx.extract.local"}, "hsx.extract.local": set()}
    inner |= {"hsx.extract.executor": {"hsx.extract.workers.actor"}, "hsx.extract.workers.actor": set()}
    assert package_cycles(inner) == []
    inner["hsx.extract.local"] = {"hsx.extract.executor"}
    assert package_cycles(inner) == [["hsx.extract.executor", "hsx.extract.local", "hsx.extract.workers"]]


def test_no_import_cycles():
    g = graph()
    assert len(g) > 40 and "hsx.job.stage" in g["hsx.extract.local"]  # the walk sees the real tree
    assert cycles(g) == []
    assert package_cycles(g) == []


def test_every_module_has_a_layer_and_none_imports_upward():
    g = graph()
    unplaced = sorted(m for m in g if package(m) not in LAYER)
    assert unplaced == []
    assert upward(g) == []


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
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr


def test_a_run_that_compiles_nothing_never_imports_the_compiler(tmp_path):
    """Every hsx process pays for its imports, and torch's compiler (inductor, the varlen kernel's
    module) is about a second of them: a packed CPU extraction that compiles nothing imports neither,
    its stored-experts and attention modules imported too; the same run compiled does (the check
    can fail)."""
    import subprocess
    import sys

    from conftest import TINY, conversations, write_jsonl

    data = write_jsonl(tmp_path / "convs.jsonl", conversations(6))
    compiler = ("torch._inductor.compile_fx", "torch.nn.attention.varlen")
    for compile_ in ("off", "on"):
        code = (
            "import sys; from typer.testing import CliRunner; from hsx.cli import app\n"
            f"args = ['extract', '--model', {str(TINY)!r}, '--data', {str(data)!r}, '--device', 'cpu',"
            f" '--out', {str(tmp_path / compile_)!r}, '--packing', 'on', '--compile', {compile_!r}]\n"
            "r = CliRunner().invoke(app, args); assert r.exit_code == 0, r.output\n"
            "import hsx.capture.quantized.experts, hsx.capture.varlen\n"
            f"print(sorted(m for m in {compiler!r} if m in sys.modules))\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert proc.returncode == 0, proc.stderr
        imported = proc.stdout.strip().splitlines()[-1]
        assert imported == ("[]" if compile_ == "off" else "['torch._inductor.compile_fx']"), (compile_, proc.stdout)
