"""The dependency direction: formats <- checkpoint <- pack <- models <-
runtime <- drafter_choice <- model_flags <- engine_setup <- serving, distributed <- the
command-line faces, and the agent launcher above serve, with kernels, sampling, tokenizer, cli and agents as leaves (over
data_files, where the files shipped beside the code are found). No
module imports from a higher layer, not even late inside a function, and module imports
form no loop. Inside serving, each API is a package (serving/openai/, anthropic/,
responses/, ollama/) over the common core (serving/*.py): no API package imports another
nor app.py (their handlers call handlers.py's), and of the core only app.py, which routes
them, imports an API package. In tests/, no test
module imports another."""

from __future__ import annotations

import ast
from pathlib import Path

import monolith

ROOT = Path(monolith.__file__).parent
# every top-level package or module of monolith, by layer: an import may only go down
LAYERS = {
    "data_files": 0,
    "formats": 1, "kernels": 1, "sampling": 1, "tokenizer": 1, "cli": 1, "agents": 1, "blas": 1,
    "checkpoint": 2, "synth": 2,
    "pack": 3,
    "models": 4,
    "runtime": 5,
    "drafter_choice": 6,
    "model_flags": 6.5,
    "engine_setup": 7,
    "serving": 8, "distributed": 8,
    "conversation": 8.5,  # chat's turns, rendered with serving's image marks
    "generate": 9, "serve": 9, "chat": 9,
    "launch": 10,  # runs serve
}


def module_name(path: Path) -> str:
    parts = ("monolith", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported monolith module, at module level?) for every import in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(n, id(node) in top_level) for n in names if n == "monolith" or n.startswith("monolith.")]
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "monolith"


FILES = sorted(ROOT.rglob("*.py"))


def test_every_top_level_unit_has_a_layer():
    units = {unit(module_name(p)) for p in FILES} - {"monolith"}
    assert units <= set(LAYERS), f"place these in LAYERS: {sorted(units - set(LAYERS))}"


def test_no_import_reaches_up_a_layer():
    upward = []
    for path in FILES:
        source = unit(module_name(path))
        if source == "monolith":
            continue
        for target, _ in imports(path):
            target_unit = unit(target)
            if target_unit != source and LAYERS.get(target_unit, 99) >= LAYERS[source]:
                upward.append(f"{module_name(path)} imports {target}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_nothing_in_monolith_imports_bench_or_tests():
    """bench/ and tests/ sit above every layer: they import monolith, never the other way
    (bench's own imports form no loop: tests/test_bench_scripts.py)."""
    found = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{module_name(path)} imports {n}" for n in names if n.split(".")[0] in ("bench", "tests")]
    assert not found, "\n".join(found)


def test_module_imports_form_no_loop():
    graph = {module_name(p): {t for t, top in imports(p) if top} for p in FILES}
    modules = set(graph)

    def resolve(target: str) -> str | None:  # `from pkg import name` may name a submodule or a symbol
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph = {m: {r for t in ts if (r := resolve(t)) and r != m} for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if n.startswith(m + "."):
                continue  # a package importing its own submodules
            if state.get(n) == 1:
                return path + [n]
            if n not in state and (loop := visit(n, path + [n])):
                return loop
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            loop = visit(m, [m])
            assert loop is None, " -> ".join(loop)


def test_tests_share_code_through_helper_modules_not_test_modules():
    """A test module imports no other test module (a split or rename of one broke another's
    collection): what tests share lives in helper modules (serving_rig.py, oracles.py,
    responses_rig.py, ...) or conftest.py."""
    tests = Path(__file__).parent
    found = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not found, "\n".join(found)


# serving's subpackages, one per API (docs/architecture.md), each with its endpoints
# (routes.py) over the common core; a subpackage without endpoints (tools/) is core
API_PACKAGES = sorted(p.parent.name for p in (ROOT / "serving").glob("*/routes.py"))


def api_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["monolith", "serving"] and len(parts) > 2 and parts[2] in API_PACKAGES else None


def test_no_api_package_imports_another_and_the_core_only_routes_them():
    assert {"openai", "anthropic", "responses"} <= set(API_PACKAGES)
    found = []
    for path in FILES:
        source = module_name(path)
        if not source.startswith("monolith.serving."):
            continue
        own = api_package(source)
        for target, _ in imports(path):
            if own is not None and target.startswith("monolith.serving.app"):
                found.append(f"{source} (API package {own}) imports {target}: the handlers are in handlers.py")
            other = api_package(target)
            if other is None or other == own:
                continue
            if own is not None:
                found.append(f"{source} (API package {own}) imports {target} (API package {other})")
            elif source != "monolith.serving.app":
                found.append(f"{source} (the common core) imports {target}: only app.py routes the API packages")
    assert not found, "\n".join(found)
