"""STYLE rule 3: imports go one way; autopar/cost/ is plain arithmetic and never imports torch."""

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "autopar"
COST_DIR = PACKAGE_DIR / "cost"


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_cost_does_not_import_torch():
    files = sorted(COST_DIR.glob("*.py"))
    assert files, f"no modules found under {COST_DIR}"
    offenders = [
        f"{path.name}: {name}"
        for path in files
        for name in _imported_modules(path)
        if name == "torch" or name.startswith("torch.")
    ]
    assert not offenders, f"autopar/cost must not import torch: {offenders}"


def test_cost_imports_only_cost_from_autopar():
    # autopar/zero_def.py, the one definition of the ZeRO stages, is plain data that cost/,
    # the planner and the runtime all read; it sits below cost/ and imports nothing of autopar
    offenders = [
        f"{path.name}: {name}"
        for path in sorted(COST_DIR.glob("*.py"))
        for name in _imported_modules(path)
        if name.startswith("autopar") and not name.startswith("autopar.cost") and name != "autopar.zero_def"
    ]
    assert not offenders, f"autopar/cost must not import the layers above it: {offenders}"
    below = [n for n in _imported_modules(PACKAGE_DIR / "zero_def.py") if n.startswith(("autopar", "torch"))]
    assert not below, f"autopar/zero_def.py must import neither autopar nor torch: {below}"


def test_cluster_and_errors_do_not_import_torch():
    offenders = [
        f"{name}: {module}"
        for name in ("cluster.py", "errors.py")
        for module in _imported_modules(PACKAGE_DIR / name)
        if module == "torch" or module.startswith("torch.")
    ]
    assert not offenders, f"planning data must not need torch: {offenders}"
