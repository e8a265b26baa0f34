"""The layers run one way, and the code stays readable in pieces.

From the ground up: ``policies`` (standard library and numpy) <- ``core`` (no Ray) <-
``actors`` (Ray mechanism) <- ``app`` (the drivers). Beside them, ``verify`` (the independent
checker of finished runs) imports no module of the product at all, not even ``core``'s step
schedule: what it recomputes of a run (``verify.replay``) is its own code, so a bug of the
product cannot hide in both (the replay alone may use torch and fbgemm's kernel); only
``app`` imports it. Every import of every module is read
with ``ast``, imports inside functions included; an import inside a function is allowed
only with a comment on its line or the line above that says ``import cost`` (a measured
cost of loading the module where it is not needed). No module over 400 lines, no function
over 80.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("policies", "core", "actors", "app")  # each may import only itself and those before it
CHECKER = "verify"
CHECKER_MAY_IMPORT = {"verify"}  # modules, or packages by their top name: none of the product
PROJECT = set(LAYERS) | {CHECKER}
THIRD_PARTY_ALLOWED = {"policies": {"numpy"}, CHECKER: {"numpy", "pyarrow", "yaml"}}  # None: any third-party package
# The replay computes the model: torch, and fbgemm's embedding kernel (the kernel, not the product's use of it).
REPLAY, REPLAY_ALLOWED = "verify/replay", {"torch", "fbgemm_gpu"}
THIRD_PARTY_FORBIDDEN = {"core": {"ray"}, "policies": set()}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
COST_MARK = "import cost"


def _modules() -> list[Path]:
    return sorted(p for layer in (*LAYERS, CHECKER) for p in (ROOT / layer).rglob("*.py"))


def _imports(tree: ast.AST) -> list[tuple[ast.stmt, str, bool]]:
    """(node, imported top module path, inside a function) for every import statement."""
    out: list[tuple[ast.stmt, str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((child, alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child, child.module, in_function))
            visit(child, nested)

    visit(tree, False)
    return out


def _explained(lines: list[str], node: ast.stmt) -> bool:
    """The import's own lines, or the block of imports and comments right above it, say
    ``import cost`` (one comment may explain a group of imports)."""
    if any(COST_MARK in line for line in lines[node.lineno - 1: node.end_lineno]):
        return True
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith(("#", "import ", "from ")):
        if COST_MARK in lines[i]:
            return True
        i -= 1
    return False


def _violations(path: Path) -> list[str]:
    layer = path.relative_to(ROOT).parts[0]
    source = path.read_text()
    lines = source.splitlines()
    where = path.relative_to(ROOT)
    found = []
    for node, module, in_function in _imports(ast.parse(source)):
        top = module.split(".")[0]
        line = f"{where}:{node.lineno}: import {module}"
        if top in PROJECT:
            found += _project_import(layer, top, module, line)
        elif top not in sys.stdlib_module_names and top != "__future__":
            allowed = THIRD_PARTY_ALLOWED.get(layer)
            if allowed is not None and str(where).startswith(REPLAY):
                allowed = allowed | REPLAY_ALLOWED
            if allowed is not None and top not in allowed:
                found.append(f"{line}: {layer}/ may import only the standard library and {sorted(allowed)}")
            if top in THIRD_PARTY_FORBIDDEN.get(layer, ()):
                found.append(f"{line}: {layer}/ must not import {top}")
        if in_function and not _explained(lines, node):
            found.append(f"{line}: inside a function without a '# {COST_MARK}: ...' comment saying why")
    return found


def _project_import(layer: str, top: str, module: str, line: str) -> list[str]:
    if layer == CHECKER:
        if top not in CHECKER_MAY_IMPORT and module not in CHECKER_MAY_IMPORT:
            return [f"{line}: {CHECKER}/ may import only {sorted(CHECKER_MAY_IMPORT)} of the project: it checks the "
                    "rest"]
        return []
    if top == CHECKER:
        return [] if layer == "app" else [f"{line}: only app/ may import {CHECKER}/"]
    if LAYERS.index(top) > LAYERS.index(layer):
        return [f"{line}: {layer}/ must not import {top}/ (layers: {' <- '.join(LAYERS)})"]
    return []


def test_imports_run_one_way_and_none_hides_in_a_function_without_a_reason():
    found = [v for path in _modules() for v in _violations(path)]
    assert not found, "\n".join(found)


def test_no_module_over_400_lines_and_no_function_over_80():
    found = []
    for path in _modules():
        source = path.read_text()
        where = path.relative_to(ROOT)
        if len(source.splitlines()) > MAX_FILE_LINES:
            found.append(f"{where}: {len(source.splitlines())} lines (max {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno}: {node.name} is {n} lines (max {MAX_FUNCTION_LINES})")
    assert not found, "\n".join(found)


def test_the_rule_itself_catches_an_upward_import(tmp_path, monkeypatch):
    # The checker must fail on what it forbids, or its passing means nothing.
    bad = ROOT / "core" / "_layer_probe_for_test.py"
    bad.write_text("import ray\n\n\ndef f():\n    from app import cli\n")
    try:
        found = _violations(bad)
    finally:
        bad.unlink()
    assert any("must not import ray" in v for v in found), found
    assert any("core/ must not import app/" in v for v in found), found
    assert any("without a '# import cost" in v for v in found), found


def test_the_rule_keeps_the_checker_off_the_product(tmp_path):
    probe = ROOT / CHECKER / "_layer_probe_for_test.py"
    probe.write_text("import ray\nfrom actors import shard\nfrom core.accounting import chain_rows\n"
                     "from core.schedule import StepSchedule\nimport policies\nfrom app import cli\n"
                     "from verify.replay.schedule import Schedule\n")
    try:
        found = _violations(probe)
    finally:
        probe.unlink()
    assert any("import ray" in v and "may import only the standard library" in v for v in found), found
    assert any("import actors" in v and "of the project" in v for v in found), found
    assert any("import core.accounting" in v for v in found), found
    assert any(":4: import core.schedule" in v and "of the project" in v for v in found), found
    assert any(":5: import policies" in v and "of the project" in v for v in found), found
    assert any(":6: import app" in v and "of the project" in v for v in found), found
    assert not any(":7: import verify" in v for v in found), found
