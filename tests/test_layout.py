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
    "__main__": {"distill", "utils"},
    "__init__": set(),
}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every absolute module name imported anywhere in `source` (relative imports resolved)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
                names.add(target)
                if not node.module:  # `from . import x` imports the submodules x
                    names.update(f"{target}.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
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
            if target != part and target not in ALLOWED[part]:
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name} ({part} -> {target})")
    return bad


def test_no_module_imports_upward():
    assert upward_imports() == []


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
