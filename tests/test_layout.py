"""The package's layering: stages import downward only, DeepSpeed lives in one module.

Read from the source with `ast` (every import, including those inside functions), so an upward import
anywhere fails here rather than as a circular import months later.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slimwise_train"

# What each top-level part of slimwise_train may import from the package (besides itself). Lower layers
# first: MoE mechanics know nothing of the stages; distill builds on prune; eval on distill; bench on all.
_SHARED = {"utils", "config", "models", "moe", "data", "testing"}
ALLOWED: dict[str, set[str]] = {
    "utils": set(),
    "testing": set(),
    "data": {"utils"},
    "moe": {"utils"},
    "config": {"utils"},
    "models": {"moe", "testing", "utils", "config"},
    "prune": _SHARED,
    "distill": _SHARED | {"prune"},
    "eval": _SHARED | {"prune", "distill"},
    "bench": _SHARED | {"prune", "distill", "eval", "lm_eval", "serve"},
    # llama.cpp serving: its own package (the engine integration); reads the suite's texts through eval
    "serve": _SHARED | {"eval"},
    # the memory planner: reads the student (distill) and the keep-set rule (prune); bench_compare runs the bench's
    # memory child to check the plan against measurement
    "plan": _SHARED | {"prune", "distill", "bench"},
    # the lm-eval `slimwise` model: the eval app's generation, metrics and report (one implementation)
    "lm_eval": _SHARED | {"eval"},
    # realistic twins of the shipped presets (python -m slimwise_train.twins): configs, adapters (MTP names), tokenizers
    "twins": _SHARED,
    "__main__": {"distill", "utils"},
    # the `slimwise` console command: runs each app's module by name (runpy), imports none of them
    "commands": set(),
    "__init__": set(),
}
# Single modules allowed more than their part, each with its reason. data/app.py is `python -m slimwise_train.data
# show`, the data layer's own entry point: it composes the app's config (config) and loads the model's tokenizer and
# context length (models); no module of the package imports it (only data/__main__.py), so nothing below data gains
# a dependency on the parts above.
MODULE_ALLOWED: dict[str, set[str]] = {
    "slimwise_train.data.app": {"config", "models"},
}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _imports(source: str, module: str, is_package: bool):
    """(target module, names imported from it, whether it was `from . import x`) per import anywhere in `source`,
    relative imports resolved; a plain `import a.b` gives ("a.b", [], False)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], False
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                yield ".".join(base + ([node.module] if node.module else [])), names, not node.module
            else:
                yield node.module, names, False


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every absolute module name imported anywhere in `source` (relative imports resolved)."""
    names = set()
    for target, imported, bare_relative in _imports(source, module, is_package):
        names.add(target)
        if bare_relative:  # `from . import x` imports the submodules x
            names.update(f"{target}.{name}" for name in imported)
    return names


def part_of(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if path.name == "__init__.py":
            module = module.rsplit(".", 1)[0]
        part = part_of(module)
        assert part in ALLOWED, f"{path}: new top-level part {part!r}: give it a row in ALLOWED"
        for name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if not name.startswith("slimwise_train."):
                continue
            target = part_of(name)
            if target != part and target not in ALLOWED[part] | MODULE_ALLOWED.get(module, set()):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name} ({part} -> {target})")
    return bad


def test_no_module_imports_upward():
    assert upward_imports() == []


def test_only_entry_points_import_the_modules_allowed_more():
    """A module of MODULE_ALLOWED is an entry point: importing it elsewhere would carry its extra parts along."""
    importers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        names = imported_modules(path.read_text(), module, path.name == "__init__.py")
        importers += [f"{module} imports {name}" for name in names & set(MODULE_ALLOWED)
                      if not module.endswith(".__main__")]
    assert importers == []


def test_moe_and_distill_rules_of_the_issue():
    # The two rules stated for the layout, independent of the table above.
    assert not ALLOWED["moe"] & {"prune", "distill", "eval", "bench"}
    assert not ALLOWED["distill"] & {"eval", "bench"}


def test_scanner_sees_imports_inside_functions_and_relative_ones():
    source = "def f():\n    from slimwise_train.eval import app\n\nfrom ..distill import trainer\nfrom . import keepset\n"
    found = imported_modules(source, "slimwise_train.moe.masking", is_package=False)
    assert "slimwise_train.eval" in found
    assert "slimwise_train.distill" in found
    assert "slimwise_train.moe.keepset" in found


def test_deepspeed_is_imported_in_exactly_one_module():
    importers = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        names = imported_modules(path.read_text(), module, path.name == "__init__.py")
        if any(n == "deepspeed" or n.startswith("deepspeed.") for n in names):
            importers.append(str(path.relative_to(PACKAGE)))
    assert importers == ["distill/engine.py"]


def test_llama_cpp_is_imported_in_exactly_one_module():
    importers = []
    for path in PACKAGE.rglob("*.py"):
        names = imported_modules(path.read_text(), _module_name(path), path.name == "__init__.py")
        if any(n == "llama_cpp" or n.startswith("llama_cpp.") for n in names):
            importers.append(str(path.relative_to(PACKAGE)))
    assert importers == ["serve/llamacpp.py"]


def test_readme_stays_a_users_page():
    readme = (PACKAGE.parent / "README.md").read_text()
    assert len(readme.splitlines()) < 300  # history goes to docs/, dated
    assert "make demo" in readme and "make test" in readme  # the two commands
    for doc in ("architecture", "benchmarks", "teacher", "faults", "serving"):
        assert f"docs/{doc}.md" in readme and (PACKAGE.parent / "docs" / f"{doc}.md").is_file()


# --------------------------------------------------------------------------- family knowledge lives in the adapters

ADAPTERS_DIR = PACKAGE / "moe" / "adapters"
# Data keyed by model_type that is a family's own entry, not a branch on it: the tiny random config of each family.
FAMILY_TABLES_ALLOWED = {PACKAGE / "testing" / "tiny.py"}
_NAMED = ("family", "model_type")  # an attribute or variable of these names holds a family / model_type


def _known_family_names() -> set[str]:
    from slimwise_train.moe.adapters.families import ADAPTERS

    return {cls.family for cls in ADAPTERS} | {mt for cls in ADAPTERS for mt in cls.model_types}


def _string_literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _named(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in _NAMED) or (isinstance(node, ast.Name) and node.id in _NAMED)


def family_branches(source: str, known: set[str], data_families: set[str], tables_allowed: bool = False) -> list[int]:
    """Lines of `source` that encode MoE family knowledge: a comparison (==, !=, in, not in, is) or a str
    startswith/endswith/removeprefix with a known family or model_type literal; `<x>.family` / `<x>.model_type` (or a
    variable so named) compared with any string literal but the synthetic suite's task families (`data_families`,
    another meaning of "family"); a `match` case on a known name; a dict literal keyed by a known name (unless
    `tables_allowed`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literals = [s for side in sides for s in _string_literals(side)]
            if set(literals) & known or (any(_named(side) for side in sides) and set(literals) - data_families):
                lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith", "removeprefix", "removesuffix")):
            literals = [s for arg in node.args for s in _string_literals(arg)]
            if _named(node.func.value) or any(lit in known for lit in literals):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and set(_string_literals(node.value)) & known:
            lines.append(node.value.lineno)
        elif isinstance(node, ast.Dict) and not tables_allowed:
            if any(key is not None and set(_string_literals(key)) & known for key in node.keys):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_family_knowledge_outside_the_adapters():
    """A new family is one adapter (docs/adding-a-family.md): nothing outside moe/adapters/ compares a family or
    model_type string, so no branch elsewhere waits to be found."""
    from slimwise_train.data.synthetic import FAMILIES as DATA_FAMILIES

    known, data_families = _known_family_names(), set(DATA_FAMILIES)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ADAPTERS_DIR in path.parents:
            continue
        for line in family_branches(path.read_text(), known, data_families, path in FAMILY_TABLES_ALLOWED):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert found == [], "family knowledge outside moe/adapters/ (give the adapter a method or attribute):\n" + \
        "\n".join(found)


def test_family_scanner_catches_the_old_branches():
    known, data = {"deepseek_v3", "gemma4", "gemma4_text", "mixtral"}, {"math", "code", "tool"}
    source = ("groups = cfg.n_group if adapter.family == 'deepseek_v3' else 1\n"          # 1: a known family
              "key = 'top_k_experts' if model_type == 'gemma4_text' else 'k'\n"          # 2: a known model_type
              "bos = model.config.model_type.startswith('gemma')\n"                        # 3: prefix of a name
              "x = {'mixtral': 'num_local_experts'}.get(model_type, 'num_experts')\n"     # 4: a table of families
              "if config.model_type in ('llama', 'mistral'):\n    pass\n"                   # 5: any model_type literal
              "if example.family == 'math':\n    pass\n"                                   # 7: the suite's family
              "if adapter.family != other_family:\n    pass\n")                            # 9: no literal
    assert family_branches(source, known, data) == [1, 2, 3, 4, 5]
    assert family_branches(source, known, data, tables_allowed=True) == [1, 2, 3, 5]


# --------------------------------------------------------------------------- no import cycle inside the package

# A cycle counts whatever kind its imports are: at module top, inside a function, or under `if TYPE_CHECKING:`. A lazy
# or type-only import still ties the two modules together (each must know the other), and "import it inside the
# function" is how a cycle is hidden until an import order trips over it. Edges are between modules: `from pkg import
# name` is an edge to pkg.name when that is a module, else to pkg (its __init__). The fix is to move the shared piece
# into the lower module (as was done for distill/lora <-> distill/student, eval/generation <-> eval/metrics,
# prune/criteria <-> prune/statistics, eval/plots <-> eval/report and bench <-> bench/cli), never to hide the import.


def _all_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        modules[name.rsplit(".", 1)[0] if path.name == "__init__.py" else name] = path
    return modules


def import_edges(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `source` imports anywhere (top, functions, TYPE_CHECKING), relative imports
    resolved, `from pkg import sub` resolved to the submodule when there is one."""
    names = set()
    for target, imported, _ in _imports(source, module, is_package):
        if not imported:
            names.add(target)
        for name in imported:
            names.add(f"{target}.{name}" if f"{target}.{name}" in known else target)
    return {name for name in names if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    modules = _all_modules()
    return {name: import_edges(path.read_text(), name, path.name == "__init__.py", set(modules))
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycle_inside_the_package():
    found = cycles(import_graph())
    assert found == [], "import cycles (move the shared piece into the lower module):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_the_three_broken_cycles_stay_broken():
    graph = import_graph()
    for lower, upper in (("slimwise_train.distill.lora", "slimwise_train.distill.student"),
                         ("slimwise_train.eval.metrics", "slimwise_train.eval.generation"),
                         ("slimwise_train.prune.criteria", "slimwise_train.prune.statistics")):
        assert lower in graph[upper] and upper not in graph[lower], (lower, upper)


def test_cycle_scanner_sees_lazy_type_only_and_package_imports():
    known = {"p", "p.a", "p.b", "p.c", "p.d"}
    sources = {
        "p.a": "from p.b import x\n",                                             # top
        "p.b": "def f():\n    from . import a\n",                                # function-local, relative
        "p.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.d import D\n",  # type-only
        "p.d": "import p.c\n",
        "p": "from p import a\n",                                                 # the package names a submodule
    }
    graph = {m: import_edges(src, m, m == "p", known) for m, src in sources.items()}
    assert graph["p.b"] == {"p.a"} and graph["p"] == {"p.a"}
    assert cycles(graph) == [["p.a", "p.b"], ["p.c", "p.d"]]


# --------------------------------------------------------------------------- every child-process test is marked

TESTS = Path(__file__).resolve().parent
SPAWN_MARKER = "subprocess"
# Calls that start a child process: subprocess.<any of these> (or the name imported from subprocess), os.system /
# os.popen / os.spawn* / os.exec* / os.fork, multiprocessing or torch.multiprocessing start, and any call naming
# torchrun / torch.distributed.run in its arguments.
_SUBPROCESS_FUNCS = {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}
_OS_FUNCS = {"system", "popen", "fork", "forkpty"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _spawns_directly(node: ast.AST, from_subprocess: set[str]) -> bool:
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Call):
            continue
        name = _dotted(sub.func)
        head, _, last = name.rpartition(".")
        if head == "subprocess" and last in _SUBPROCESS_FUNCS or not head and last in from_subprocess:
            return True
        if head == "os" and (last in _OS_FUNCS or last.startswith(("spawn", "exec"))):
            return True
        if head.endswith("multiprocessing") and last in ("spawn", "start_processes", "Process", "Pool"):
            return True
        literals = [n.value for n in ast.walk(sub) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if any(lit in ("torchrun", "torch.distributed.run") for lit in literals):
            return True
    return False


def _has_marker(decorators, marker: str) -> bool:
    for dec in decorators:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if _dotted(target).endswith(f"mark.{marker}"):
            return True
    return False


def _pytestmark(body, marker: str) -> bool:
    for node in body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if _has_marker(values, marker):
                return True
    return False


def _is_fixture(fn) -> bool:
    return any(_dotted(d.func if isinstance(d, ast.Call) else d).endswith("fixture") for d in fn.decorator_list)


class _Module:
    """One test module's functions (module level and in classes), the helpers it imports from tests/ modules, and
    which of them start a child process, directly or through a helper, another function or a fixture they use."""

    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.functions: dict[str, ast.AST] = {}
        self.tests: list[tuple[str, ast.AST, bool]] = []  # (name, node, marked by its class or module)
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (tests/ module, name there)
        self.from_subprocess: set[str] = set()
        module_marked = _pytestmark(self.tree.body, SPAWN_MARKER)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if node.module == "subprocess":
                        self.from_subprocess.add(alias.asname or alias.name)
                    elif (TESTS / f"{node.module}.py").is_file():
                        self.imported[alias.asname or alias.name] = (node.module, alias.name)
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
                if node.name.startswith("test"):
                    self.tests.append((node.name, node, module_marked))
            elif isinstance(node, ast.ClassDef):
                class_marked = module_marked or _pytestmark(node.body, SPAWN_MARKER) or \
                    _has_marker(node.decorator_list, SPAWN_MARKER)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                        self.tests.append((f"{node.name}.{item.name}", item, class_marked))
        self.fixtures = {name for name, fn in self.functions.items() if _is_fixture(fn)}


class SpawnScan:
    """Which functions of tests/*.py start a child process, transitively (fixed point over the calls, references and
    fixture parameters of each function; conftest fixtures are visible to every module)."""

    def __init__(self, paths):
        self.modules = {p.stem: _Module(p) for p in paths}
        self.spawning: set[tuple[str, str]] = set()
        for stem, mod in self.modules.items():
            for name, fn in mod.functions.items():
                if _spawns_directly(fn, mod.from_subprocess):
                    self.spawning.add((stem, name))
            for name, fn, _ in mod.tests:
                if _spawns_directly(fn, mod.from_subprocess):
                    self.spawning.add((stem, name))
        conftest = self.modules.get("conftest")
        self.conftest_fixtures = conftest.fixtures if conftest else set()
        changed = True
        while changed:
            changed = False
            for stem, mod in self.modules.items():
                for name, fn in [*mod.functions.items(), *((n, f) for n, f, _ in mod.tests)]:
                    if (stem, name) not in self.spawning and self._uses_spawning(stem, fn):
                        self.spawning.add((stem, name))
                        changed = True

    def _resolve(self, stem: str, name: str) -> tuple[str, str] | None:
        mod = self.modules[stem]
        if name in mod.functions:
            return stem, name
        if name in mod.imported:
            return mod.imported[name]
        return None

    def _uses_spawning(self, stem: str, fn) -> bool:
        mod = self.modules[stem]
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Name) and sub.id != fn.name and self._resolve(stem, sub.id) in self.spawning:
                return True
        for arg in fn.args.args:  # fixtures it requests: the module's own, else conftest's
            if arg.arg in mod.fixtures and (stem, arg.arg) in self.spawning:
                return True
            if arg.arg not in mod.fixtures and arg.arg in self.conftest_fixtures and ("conftest", arg.arg) in \
                    self.spawning:
                return True
        return False

    def unmarked(self) -> list[str]:
        out = []
        for stem, mod in self.modules.items():
            for name, fn, marked in mod.tests:
                if (stem, name) in self.spawning and not (marked or _has_marker(fn.decorator_list, SPAWN_MARKER)):
                    out.append(f"{mod.path.name}::{name}")
        return sorted(out)


def test_every_test_that_starts_a_child_process_is_marked():
    """`-m "not subprocess"` (make test-fast) must mean "no child process": every test whose code (or a helper,
    function or fixture it uses, in its module, tests/helpers*.py or conftest.py) starts one carries
    @pytest.mark.subprocess, itself or through its class's or module's `pytestmark`."""
    assert sorted(SpawnScan(sorted(TESTS.glob("*.py"))).unmarked()) == [], "add @pytest.mark.subprocess"


def test_spawn_scanner_follows_helpers_fixtures_and_module_marks(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "import pytest, subprocess\n@pytest.fixture\ndef cli():\n    return subprocess.run(['true'])\n")
    (tmp_path / "test_a.py").write_text(
        "import sys, pytest\nfrom subprocess import Popen\n"
        "def launch(args):\n    return Popen([sys.executable, *args])\n"
        "def via_helper():\n    launch([])\n"
        "@pytest.fixture(scope='module')\ndef runs():\n    via_helper()\n"
        "def test_direct():\n    import subprocess\n    subprocess.check_output(['ls'])\n"
        "def test_helper():\n    via_helper()\n"
        "def test_fixture(runs):\n    pass\n"
        "def test_conftest_fixture(cli):\n    pass\n"
        "def test_torchrun():\n    cmd(['torchrun', '--nproc_per_node=2'])\n"
        "@pytest.mark.subprocess\ndef test_marked():\n    launch([])\n"
        "def test_pure():\n    assert 1 + 1 == 2\n"
        "class TestGroup:\n    pytestmark = pytest.mark.subprocess\n    def test_in_class(self):\n        launch([])\n")
    (tmp_path / "test_b.py").write_text(
        "import pytest\nfrom test_a import launch\npytestmark = [pytest.mark.dist, pytest.mark.subprocess]\n"
        "def test_module_marked():\n    launch([])\n")
    (tmp_path / "test_c.py").write_text("from test_a import launch as go\ndef test_imported_helper():\n    go([])\n")
    global TESTS
    saved, TESTS = TESTS, tmp_path  # _Module resolves `from <tests module> import` against TESTS
    try:
        found = SpawnScan(sorted(tmp_path.glob("*.py"))).unmarked()
    finally:
        TESTS = saved
    assert found == ["test_a.py::test_conftest_fixture", "test_a.py::test_direct", "test_a.py::test_fixture",
                     "test_a.py::test_helper", "test_a.py::test_torchrun", "test_c.py::test_imported_helper"]
