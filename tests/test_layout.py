"""The package's shape, as a newcomer relies on it: imports point one way (app -> bench -> engine -> policies /
storage), no import circles between modules, no module over 400 lines, C++ in .cpp files."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "bench", "core", "policies", "storage")
MAX_LINES = 400

#: Which top-level parts may import which (a part imports itself freely). ``core``'s sub-packages are checked below.
ALLOWED = {
    "app": {"bench", "core", "policies", "storage"},
    "bench": {"core", "policies", "storage"},
    "core": {"policies", "storage"},
    "policies": set(),
    "storage": set(),
}
#: Inside the engine: the conversation (engine) on top, then recall, the model's loading, the decode step, the
#: cache, the device operators at the bottom.
CORE_ALLOWED = {
    "engine": {"recall", "model", "decode", "cache", "ops"},
    "recall": {"cache"},
    "model": {"decode", "cache"},
    "decode": {"cache", "ops"},
    "cache": set(),
    "ops": set(),
}


def _modules() -> dict[str, Path]:
    out = {}
    for part in PACKAGES:
        for path in sorted((ROOT / part).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every kvchat module ``name`` imports, at the top or inside a function."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            here = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join(here + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvchat."):
            target = node.module.removeprefix("kvchat.")
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("kvchat.") for a in node.names if a.name.startswith("kvchat.")}
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _part(module: str) -> str:
    return module.split(".")[0]


def test_imports_point_one_way():
    wrong = []
    for module, targets in _graph().items():
        for target in targets:
            a, b = _part(module), _part(target)
            if a != b and b not in ALLOWED[a]:
                wrong.append(f"{module} imports {target}")
            if a == b == "core" and module.count(".") >= 2 and target.count(".") >= 2:
                sa, sb = module.split(".")[1], target.split(".")[1]
                if sa != sb and sb not in CORE_ALLOWED[sa]:
                    wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layers' direction:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    graph = _graph()
    circles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_module_over_400_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_cpp_lives_in_cpp_files():
    offenders = [str(p.relative_to(ROOT)) for p in _modules().values()
                 if "#include <" in p.read_text() or "TORCH_LIBRARY" in p.read_text()]
    assert not offenders, f"C++ source inside Python modules: {offenders}"
    assert list((ROOT / "core" / "ops").rglob("*.cpp")), "the device operators' C++ sources are .cpp files"


def test_the_checks_see_a_circle_and_a_wrong_arrow(tmp_path, monkeypatch):
    """The checks above can fail: a storage module importing the engine is caught both ways."""
    graph = _graph()
    graph["storage.db"] = graph["storage.db"] | {"core.engine.session"}
    monkeypatch.setattr(__import__(__name__), "_graph", lambda: graph)
    try:
        test_imports_point_one_way()
    except AssertionError as exc:
        assert "storage.db imports core.engine.session" in str(exc)
    else:
        raise AssertionError("a storage module importing the engine was not caught")
