"""What is generated from the declared settings stays generated: the policies table in README.md and the flags table
in docs/usage.md, and nothing outside the engine reaching into a session's or a cache's private state."""

import re

from helpers import REPO
from kvchat.app import docs
from kvchat.core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS
from kvchat.policies import POLICIES

# Outside core/, a session is read through its public methods (core/engine/reading.py): no private attribute of another
# object (``session._lock``, ``entry.session._streaming``, ``layer._allocate``), no walking of the cache's layers or
# the session's token log.
PRIVATE = re.compile(r"\b([A-Za-z_][\w.]*)\.(_[A-Za-z]\w*)")
INTERNALS = re.compile(r"\.cache\.layers\b|\.layers\[|\bsession\.log\b|\.log\.column\b|\._dims\b|\._allocate\b")
SCANNED = ("app", "bench", "storage", "policies")


def _offences(path, text):
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        private = [m.group(0) for m in PRIVATE.finditer(code) if m.group(1) not in ("self", "cls")
                   and not m.group(2).startswith("__")]
        internal = [m.group(0) for m in INTERNALS.finditer(code)]
        if private or internal:
            yield n, line.strip(), private + internal


def test_nothing_outside_the_engine_reaches_into_a_session_or_a_cache():
    offenders = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for n, line, what in _offences(path, path.read_text(encoding="utf-8")):
                offenders.append(f"{rel}:{n}: {', '.join(what)}: {line}")
    assert not offenders, "private state read outside core/:\n" + "\n".join(offenders)


def test_the_offence_patterns_catch_what_they_should():
    bad = ["with session._lock:", "held = entry.session._streaming", "s._undo = None", "x = session.cache.layers[0]",
           "for layer in s.cache.layers:", "n = session.log.n", "layer._allocate([4])", "c._dims"]
    good = ["with self._lock:", "self._per_position = 1", "session.read_messages()", "s.cache_now()['length']",
            "obj.__class__", "# session._lock in a comment"]
    assert [len(list(_offences(None, line))) for line in bad] == [1] * len(bad)
    assert [len(list(_offences(None, line))) for line in good] == [0] * len(good)


def test_the_generated_tables_are_current():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    usage = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    assert docs.render(readme, ("policies",)) == readme, \
        "README.md's policies table is out of date: run python -m kvchat.app.docs --write"
    assert docs.render(usage, ("flags",)) == usage, \
        "docs/usage.md's flags table is out of date: run python -m kvchat.app.docs --write"
    assert docs.policy_table() in readme and docs.flag_table() in usage
    assert docs.main(["--check"]) == 0


def test_the_tables_cover_every_declaration():
    flags, policies = docs.flag_table(), docs.policy_table()
    for p in (*CACHE_SETTINGS, *SAMPLING_SETTINGS):
        assert f"| `{p.flag}` | " in flags
    for name, cls in POLICIES.items():
        link = re.search(rf"\| \[`{name}`\]\(([^)]+)\) \| {re.escape(cls.summary)}", policies)
        assert link, f"{name}'s row does not link to its file"
        assert f"class {cls.__name__}(" in (REPO / link[1]).read_text(encoding="utf-8")  # its rule, one click away
        for p in cls.params:
            assert f"`{p.flag} {p.shown_default}`" in policies


def _stale_pair(tmp_path):
    readme, usage = tmp_path / "README.md", tmp_path / "usage.md"
    readme.write_text("intro\n<!-- generated: policies -->\nSTALE\n<!-- end -->\nafter\n", encoding="utf-8")
    usage.write_text("flags:\n<!-- generated: flags -->\nSTALE\n<!-- end -->\nmore\n", encoding="utf-8")
    return readme, usage, ["--readme", str(readme), "--usage", str(usage)]


def test_docs_write_and_check(tmp_path, capsys):
    readme, usage, files = _stale_pair(tmp_path)
    assert docs.main(["--check", *files]) == 1
    assert docs.main(["--write", *files]) == 0
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith("<!-- end -->\nafter\n") and "STALE" not in text
    assert docs.policy_table() in text and docs.flag_table() not in text
    text = usage.read_text(encoding="utf-8")
    assert text.startswith("flags:\n") and text.endswith("<!-- end -->\nmore\n") and "STALE" not in text
    assert docs.flag_table() in text and docs.policy_table() not in text
    assert docs.main(["--check", *files]) == 0


def test_docs_check_fails_when_either_table_is_stale(tmp_path, capsys):
    readme, usage, files = _stale_pair(tmp_path)
    assert docs.main(["--write", *files]) == 0
    current = {path: path.read_text(encoding="utf-8") for path in (readme, usage)}
    for path in (readme, usage):
        path.write_text(current[path].replace("| --- |", "| --- | STALE |", 1), encoding="utf-8")
        capsys.readouterr()
        assert docs.main(["--check", *files]) == 1
        assert str(path) in capsys.readouterr().err
        path.write_text(current[path], encoding="utf-8")
        assert docs.main(["--check", *files]) == 0


def test_docs_refuses_a_file_without_its_markers(tmp_path, capsys):
    readme, usage, files = _stale_pair(tmp_path)
    usage.write_text("no markers here\n", encoding="utf-8")
    assert docs.main(["--write", *files]) == 1
    assert "generated: flags" in capsys.readouterr().err
    assert "STALE" in readme.read_text(encoding="utf-8"), "nothing is written when one file lacks its markers"
