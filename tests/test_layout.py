"""The package's shape, as a newcomer relies on it: imports point one way (app -> bench -> engine -> policies /
storage), no import circles between modules, no module over 400 lines, C++ in .cpp files; docs/architecture.md's map
names every module, and the documents' links lead somewhere."""

from __future__ import annotations

import ast
import re
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


def _map_gaps(architecture: str, readme: str) -> list[str]:
    """What docs/architecture.md's map leaves out: a folder of modules with no section of its own, a module its
    folder's section does not name (a policy's own module is named by the README's policies table instead)."""
    sections = dict(re.findall(r"^## `([\w/]+)/`[^\n]*\n(.*?)(?=^## |\Z)", architecture, flags=re.M | re.S))
    gaps = []
    for folder in sorted({p.parent for p in _modules().values()}):
        rel = folder.relative_to(ROOT).as_posix()
        modules = [p for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
        if modules and rel not in sections:
            gaps.append(f"{rel}/ has no section")
        for path in modules if rel in sections else ():
            own_policy = rel == "policies" and re.search(r"^@register$", path.read_text(), flags=re.M)
            named = f"({rel}/{path.name})" in readme if own_policy else f"`{path.name}`" in sections[rel]
            if not named:
                gaps.append(f"{rel}/{path.name} is not named")
    return gaps


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _broken_links(files: list[Path]) -> list[str]:
    """Relative links in ``files`` to a file that does not exist, or to a heading a Markdown file does not have."""
    broken = []
    for doc in files:
        text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path) if path else doc
            headings = re.findall(r"^#+ (.*)$", dest.read_text(encoding="utf-8"), flags=re.M) \
                if dest.suffix == ".md" and dest.is_file() else []
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in map(_slug, headings)):
                broken.append(f"{doc.name}: {target}")
    return broken


def test_the_map_names_every_module():
    """A newcomer finds every module in docs/architecture.md, under its folder (a policy: in the README's table)."""
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    gaps = _map_gaps(architecture, readme)
    assert not gaps, "docs/architecture.md leaves out:\n" + "\n".join(gaps)
    assert _map_gaps(architecture.replace("`db.py`", "`database.py`"), readme) == ["storage/db.py is not named"]
    assert _map_gaps(architecture, readme.replace("(policies/h2o.py)", "")) == ["policies/h2o.py is not named"]


def test_the_documents_links_lead_somewhere(tmp_path):
    """Every relative link in README.md and docs/ names a file that exists, and a heading it has."""
    broken = _broken_links([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
    (tmp_path / "here.md").write_text("# Here, at last\n", encoding="utf-8")
    probe = tmp_path / "probe.md"
    links = "[a](gone.md) [b](here.md#nowhere) [c](here.md#here-at-last) [d](https://x.org/)"
    probe.write_text(links, encoding="utf-8")
    assert _broken_links([probe]) == ["probe.md: gone.md", "probe.md: here.md#nowhere"]
