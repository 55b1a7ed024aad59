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
