"""The command line: replay, policies, conversations, terminal chat, and one-line errors with exit status 2."""

import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvchat.app.cli import main
from kvchat.app.scripts import ScriptError, load_scripts
from kvchat.storage.db import Store
from tinymodels import build_tiny

from helpers import data_file, write_jsonl

SCRIPT = [
    {"system": "You are terse."},
    {"user": "My name is Alice."},
    {"assistant": "Hello Alice."},
    {"user": "What is my name?", "expect": "Alice"},
    {"user": "Repeat my name.", "reference": "Your name is Alice.", "expect": "Alice"},
    {"user": "Say more. " * 30},
]


@pytest.fixture(scope="module")
def no_template_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("no-template")
    build_tiny("llama", tokenizer).save_pretrained(path)
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = None
    tok.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_json_turns_and_summary(model_dir, tmp_path, capsys):
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT)
    db = tmp_path / "kv.db"
    code, out, _ = _run(capsys, "replay", script, "--model", model_dir, "--policy", "streaming", "--budget", 48,
                        "--window", 8, "--slack", 6, "--max-new-tokens", 6, "--db", db, "--json")
    assert code == 0
    lines = [json.loads(x) for x in out.splitlines()]
    turns, summary = lines[:-1], lines[-1]["summary"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4]
    for key in ("role", "prompt_tokens", "new_tokens", "cache_tokens", "cache_bytes", "evicted_tokens",
                "prefill_ms", "decode_ms_per_token", "answer", "expect", "hit", "expect_nll"):
        assert key in turns[0]
    assert turns[0]["answer"] == "Hello Alice." and turns[0]["new_tokens"] == 0
    assert turns[1]["expect"] == "Alice" and isinstance(turns[1]["hit"], bool)
    assert turns[2]["expect_nll"] > 0 and turns[2]["new_tokens"] == 0
    assert summary["policy"] == "streaming" and summary["turns"] == 4 and summary["expected"] == 2
    assert summary["max_cache_tokens"] <= 48 + 6 and summary["evicted_tokens"] > 0
    assert summary["params"]["budget"] == 48
    for key in ("total_tokens", "max_cache_bytes", "hits", "mean_expect_nll", "wall_s", "peak_rss_mb"):
        assert key in summary
    assert len(Store(db).conversations()) == 1


def test_an_unsaved_replay_recalls_from_a_temporary_archive(model_dir, tmp_path, capsys, monkeypatch):
    """``--no-save`` with recall on (the default) recalls as a stored replay does: its digests live in a temporary
    folder, deleted when the replay ends; nothing is stored."""
    import tempfile

    monkeypatch.setattr("kvchat.core.recall.choose.HELD_QUANTILE", 0.0)  # random weights: recall whatever scores best
    monkeypatch.setattr("kvchat.core.recall.gate.keeps", lambda without, with_recall: True)  # and keep it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    lines = [line for i, w in enumerate(["red", "blue", "green", "grey", "pink", "gold", "teal", "tan"])
             for line in ({"user": f"Fact {i}: the {w} box holds {i * 7} stones. Keep it."},
                          {"assistant": f"Noted, {i * 7}."})]
    script = write_jsonl(tmp_path / "s.jsonl", lines + [{"user": "How many stones are in the red box?"}])
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, "--budget", 48, "--window", 8, "--slack", 6,
                          "--max-new-tokens", 4, "--no-save", "--json", "--db", tmp_path / "kv.db")
    assert code == 0, err
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert summary["params"]["recall"] == "on" and summary["recalled_tokens"] > 0
    assert not (tmp_path / "kv.db").exists() and list((tmp_path / "tmp").iterdir()) == []


def test_several_scripts_one_model_load(model_dir, tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", SCRIPT[:3])
    b = write_jsonl(tmp_path / "b.jsonl", SCRIPT[1:4])
    code, out, err = _run(capsys, "replay", a, b, "--model", model_dir, "--budget", 64, "--max-new-tokens", 4,
                          "--db", tmp_path / "kv.db", "--json")
    assert code == 0 and err.count("loading") == 1
    lines = [json.loads(x) for x in out.splitlines()]
    summaries = [x["script_summary"] for x in lines if "script_summary" in x]
    assert [s["script"] for s in summaries] == [str(a), str(b)]
    assert lines[-1]["summary"]["turns"] == sum(s["turns"] for s in summaries)
    assert len(Store(tmp_path / "kv.db").conversations()) == 2


def test_decode_through_the_model_replays_the_same_chat(model_dir, tmp_path, capsys, monkeypatch):
    """--decode model (every step through the model's forward) and the default step give the same greedy replies."""
    from kvchat.core.decode.eager import DecodeStep

    steps = []
    step = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT)
    answers, counts = [], []
    for decode in ("auto", "model"):
        code, out, _ = _run(capsys, "replay", script, "--model", model_dir, "--budget", 48, "--window", 8, "--slack",
                            6, "--max-new-tokens", 8, "--temperature", 0, "--no-save", "--json", "--decode", decode)
        assert code == 0
        answers.append([json.loads(x)["answer"] for x in out.splitlines()[:-1]])
        counts.append(len(steps))
    assert counts[0] > 0 and counts[1] == counts[0]  # the step ran with auto only
    assert answers[0] == answers[1] and any(answers[0])
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(script), "--model", str(model_dir), "--decode", "fast"])
    assert exc.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err


def test_human_readable_replay(model_dir, tmp_path, capsys):
    code, out, err = _run(capsys, "replay", write_jsonl(tmp_path / "s.jsonl", SCRIPT[:3]), "--model", model_dir,
                          "--budget", 64, "--no-save")
    assert code == 0 and "summary: streaming 1 turns" in out and "prefill" in err


def test_policies_listing(capsys):
    code, out, _ = _run(capsys, "policies")
    assert code == 0 and all(name in out for name in ("full", "window", "streaming"))
    code, out, _ = _run(capsys, "policies", "--json")
    assert set(json.loads(out)) >= {"full", "window", "streaming"}


def test_conversations_list_show_export(model_dir, tmp_path, capsys):
    db = tmp_path / "kv.db"
    _run(capsys, "replay", write_jsonl(tmp_path / "s.jsonl", SCRIPT[:3]), "--model", model_dir, "--budget", 64,
         "--db", db, "--json")
    code, out, _ = _run(capsys, "conversations", "list", "--db", db)
    assert code == 0 and "s.jsonl" in out
    (conv,) = Store(db).conversations()
    cid, folder = conv["id"], Store(db).archive_folder(conv["archive"])
    on_disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())  # rows, state file, digests
    assert conv["disk_bytes"] == on_disk > 0 and f"{on_disk / 2**20:7.1f} MB" in out
    code, out, _ = _run(capsys, "conversations", "list", "--db", db, "--json")
    assert [r["disk_bytes"] for r in json.loads(out)] == [on_disk]
    code, out, _ = _run(capsys, "conversations", "list", "--db", db, "--search", "ALICE")  # a message's word
    assert code == 0 and "s.jsonl" in out
    code, out, _ = _run(capsys, "conversations", "list", "--db", db, "--search", "Zanzibar")
    assert code == 0 and out.startswith("no conversations with “Zanzibar”")
    code, _, err = _run(capsys, "conversations", "show", cid, "--db", db, "--search", "x")
    assert code == 2 and "--search lists conversations: it goes with list" in err
    code, out, _ = _run(capsys, "conversations", "show", cid, "--db", db)
    assert "[user] My name is Alice." in out
    code, _, err = _run(capsys, "conversations", "export", cid, "--db", db, "-o", tmp_path / "x.jsonl")
    assert code == 0 and err.strip() == f"replay it as it began: kvchat replay {tmp_path / 'x.jsonl'} --model " \
        f"{model_dir} --budget 64"
    assert [json.loads(x) for x in (tmp_path / "x.jsonl").read_text().splitlines()] == SCRIPT[:3]
    for action in ("show", "export"):  # export wrote an empty script and exited 0
        code, _, err = _run(capsys, "conversations", action, 999, "--db", db, "-o", tmp_path / "none.jsonl")
        assert code == 2 and "no conversation 999" in err, action
    assert not (tmp_path / "none.jsonl").exists()


def test_set_changes_the_running_policys_own_parameters(tiny):
    """``/set heavy=16`` under h2o changes that parameter and keeps the policy's others; a parameter of another policy
    or any bad value is an error and changes nothing."""
    from kvchat.app.args import CLIError
    from kvchat.app.terminal import _set
    from kvchat.core.engine.session import Session
    from kvchat.core.engine.settings import Settings

    session = Session(tiny("llama"), Settings(policy="h2o", budget=48, window=8, slack=6, params={"average": "no"}))
    assert _set(session, ["heavy=16", "temperature=0.3"]) == {"params": {"average": False, "heavy": 16},
                                                              "temperature": 0.3}
    assert session.policy.heavy == 16 and session.policy.average is False
    for pairs, message in [(["obs_window=4"], "a parameter of snapkv, cake, headaware: /policy snapkv"),
                           (["heavy=2", "top_k=x"], "top_k must be"), (["heavy=-1"], "heavy must be >= 0"),
                           ([], "/set takes key=value")]:
        with pytest.raises((CLIError, ValueError), match=message):
            _set(session, pairs)
    assert session.settings.params == {"average": False, "heavy": 16} and session.sampling.top_k == 0


def test_conversations_before_any_is_stored(tmp_path, capsys, monkeypatch):
    """On a machine where kvchat has stored nothing yet, listing the conversations lists none (and creates no
    database); a --db that is not there, or a conversation asked for by id, is an error."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    code, out, _ = _run(capsys, "conversations", "list")
    assert code == 0 and out.startswith("no conversations yet") and str(tmp_path / "home") in out
    code, out, _ = _run(capsys, "conversations", "list", "--json")
    assert code == 0 and json.loads(out) == []
    assert not (tmp_path / "home").exists()
    for argv in (["list", "--db", tmp_path / "typo.db"], ["show", "1"]):
        code, _, err = _run(capsys, "conversations", *argv)
        assert code == 2 and err.startswith("kvchat: error: no database at"), argv


def test_commands_that_decode_nothing_load_no_model_code(tmp_path):
    """``kvchat --help``, ``policies`` and ``conversations`` answer without importing transformers or
    ``torch.compile``'s machinery (seconds here: 4.6-5.7 s for these commands before, about 2 s now), and ``bench``'s
    own options are still there when it is the command."""
    probe = (
        "import sys, contextlib, io\n"
        "from kvchat.app.cli import main\n"
        "for argv in (['policies'], ['conversations', 'list'], ['--help'], ['chat', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "heavy = sorted(m for m in ('transformers', 'torch._dynamo', 'kvchat.core.engine.session')\n"
        "               if m in sys.modules)\n"
        "print(heavy)\n")
    env = {**os.environ, "KVCHAT_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    out = subprocess.run([sys.executable, "-m", "kvchat.app.cli", "bench", "speed", "--help"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0 and "--lengths" in out.stdout, out.stderr


@pytest.mark.parametrize("args, content, message", [
    (["--policy", "nope"], SCRIPT, "unknown policy 'nope'"),
    (["--budget", "10", "--sink", "4", "--window", "8"], SCRIPT, "must be at least sink + window"),
    ([], "{\"user\": \"hi\"}\n{\"user\": \n", ":2: invalid JSON"),
    ([], "{\"user\": \"hi\"}\n{\"user\": \"  \"}\n", ":2: user is empty"),
    ([], "{\"user\": \"hi\", \"colour\": 1}\n", ":1: unknown key colour"),
    ([], "{\"user\": \"hi\", \"reference\": \"x\"}\n", ":1: a reference line needs \"expect\""),
    ([], b"{\"user\": \"caf\xe9\"}\n", "not UTF-8"),
    ([], "", "the script is empty"),
    (["--device", "gpu"], SCRIPT, "unknown device 'gpu'"),
    (["--resume", "999", "--budget", "128"], SCRIPT, "no conversation 999 in"),
])
def test_bad_input_is_one_line_and_exit_2(model_dir, tmp_path, capsys, args, content, message):
    script = tmp_path / "bad.jsonl"
    script.write_bytes(content if isinstance(content, bytes) else
                       content.encode() if isinstance(content, str) else
                       "".join(json.dumps(x) + "\n" for x in content).encode())
    db = tmp_path / "kv.db"
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, "--db", db, *args)
    assert code == 2
    lines = [x for x in err.splitlines() if x.startswith("kvchat: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert not db.exists() or Store(db).conversations() == []


def test_a_package_outside_its_declared_range_is_refused_in_one_line(monkeypatch, capsys):
    """An environment installed with --no-deps, or changed after kvchat: a package outside the range pyproject.toml
    declares for it (transformers before 5.17 fails only at the first cache, with a TypeError from its cache classes)
    or missing is named before anything loads; the installed environment itself passes."""
    from importlib import metadata

    assert main(["policies"]) == 0 and capsys.readouterr().err == ""  # this environment is within every range
    real_version = metadata.version
    declared = ["torch>=2.11", "transformers<6,>=5.17", "gradio<7,>=6.0", 'pytest>=8; extra == "test"']
    monkeypatch.setattr(metadata, "requires", lambda dist: declared)
    for name, have in [("transformers", "5.12.0"), ("transformers", "6.0.0"), ("torch", "2.10.0+cu128")]:
        monkeypatch.setattr(metadata, "version", lambda pkg: have if pkg == name else real_version(pkg))
        assert main(["policies"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        needs = rf"{name}[<>=0-9.,]+"
        assert re.fullmatch(rf"kvchat: error: kvchat needs {needs}, but {name} {re.escape(have)} is installed: "
                            rf"pip install '{needs}'\n", err), err

    monkeypatch.setattr(metadata, "version", lambda pkg: "custom-build" if pkg == "torch" else real_version(pkg))
    assert main(["policies"]) == 0  # a version string that is not PEP 440 is not judged (nor a reason to refuse)
    capsys.readouterr()

    def missing(pkg):
        if pkg in ("gradio", "pytest"):
            raise metadata.PackageNotFoundError(pkg)
        return real_version(pkg)

    monkeypatch.setattr(metadata, "version", missing)  # pytest is an extra's: not asked for
    assert main(["policies"]) == 2
    err = capsys.readouterr().err
    assert "kvchat needs gradio>=6.0,<7, which is not installed: pip install 'gradio>=6.0,<7'" in err

    monkeypatch.setattr(metadata, "version", lambda pkg: "5.12.0" if pkg == "transformers" else real_version(pkg))
    for marker, code in [('python_version >= "3"', 2), ('sys_platform == "no-such-platform"', 0)]:
        monkeypatch.setattr(metadata, "requires", lambda dist: [f"transformers<6,>=5.17; {marker}"])
        assert main(["policies"]) == code, marker  # a platform's requirement: judged where its marker holds
        capsys.readouterr()

    def not_installed(dist):  # a source tree run without installing: nothing declared to check against
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "requires", not_installed)
    assert main(["policies"]) == 0


def test_model_errors(no_template_dir, tmp_path, capsys):
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT[1:2])
    code, _, err = _run(capsys, "replay", script, "--model", no_template_dir, "--db", tmp_path / "kv.db")
    assert code == 2 and "no chat template" in err
    for command in ("chat", "replay", "serve"):  # a mistyped path: refused before anything loads
        for model, message in (("./does/not/exist", "no such model directory"), (tmp_path / "missing.gguf",
                               "no such GGUF file"), (tmp_path, "is not a model directory (no config.json)")):
            code, _, err = _run(capsys, command, *([script] if command == "replay" else []), "--model", model,
                                "--db", tmp_path / "kv.db")
            assert code == 2 and message in err and "loading" not in err, err
    assert Store(tmp_path / "kv.db").conversations() == [] if (tmp_path / "kv.db").exists() else True


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: --device cuda is no error here")
def test_a_device_this_torch_cannot_reach_is_one_line_and_exit_2(model_dir, tmp_path, capsys):
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT[1:2])
    for device in ("cuda", "cuda:1"):
        code, _, err = _run(capsys, "replay", script, "--model", model_dir, "--db", tmp_path / "kv.db",
                            "--device", device)
        lines = [x for x in err.splitlines() if x.startswith("kvchat: error:")]
        assert code == 2 and len(lines) == 1 and f"--device {device}: no CUDA GPU available" in lines[0], err


def test_terminal_chat_with_commands(model_dir, tmp_path):
    db = tmp_path / "kv.db"
    stdin = ("Hello there\n/budget 40\n/policy window\n/set groups=sentence\n/stats\n/budget x\n/budget -5\n/budget\n"
             "/set heavy=8\n/policy h2o heavy 8\n/policy h2o groups=turn\nAgain\n/quit\n")
    proc = subprocess.run([sys.executable, "-m", "kvchat.app.cli", "chat", "--model", str(model_dir), "--db", str(db),
                           "--budget", "64", "--window", "8", "--max-new-tokens", "5"],
                          input=stdin, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "deprecated" not in proc.stderr, proc.stderr  # a fresh chat warns nothing
    assert proc.stdout.count("bot> ") == 2
    assert "applied: budget=40" in proc.stdout and "applied: policy=window" in proc.stdout
    assert "kvchat: error: budget must be a whole number, got 'x'" in proc.stderr  # its declaration's words
    assert "kvchat: error: budget must be >= 1, got -5" in proc.stderr  # "needs one number", of a number
    assert "kvchat: error: /budget needs one number" in proc.stderr
    assert "/set cannot change 'heavy'; a parameter of h2o: /policy h2o heavy=VALUE" in proc.stderr
    assert "/policy takes its parameters as key=value, got 'heavy'" in proc.stderr  # was dropped without a word
    assert "groups is a setting, not a parameter of h2o: /set groups=turn" in proc.stderr  # "h2o has no groups"
    (conv,) = Store(db).conversations()
    assert conv["settings"]["policy"] == "window" and conv["settings"]["groups"] == "sentence"
    # ... and it resumes exactly as its last turn (and the settings changes after it) left the cache.
    proc = subprocess.run([sys.executable, "-m", "kvchat.app.cli", "chat", "--model", str(model_dir), "--db", str(db),
                           "--resume", str(conv["id"]), "--max-new-tokens", "3"],
                          input="One more\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "cache restored from archive" in proc.stderr
    assert len(Store(db).messages(conv["id"])) == 7


def test_a_message_between_triple_quotes_runs_over_lines(model_dir, tmp_path, capsys, monkeypatch):
    """A pasted text with its line breaks and blank lines is one message between \"\"\" lines (pasted without them,
    each line was a message of its own, each answered); input that ends inside one is a one-line error, nothing of
    it sent."""
    db = tmp_path / "kv.db"
    monkeypatch.setattr("sys.stdin", io.StringIO('"""\nChapter 1\n\nIt was a dark night.\n  Indented.\n"""\n'
                                                 '"""One line."""\nAnd a plain one.\n'))
    code, out, err = _run(capsys, "chat", "--model", model_dir, "--db", db, "--budget", 64, "--max-new-tokens", 3)
    assert code == 0, err
    (conv,) = Store(db).conversations()
    users = [m["text"] for m in Store(db).messages(conv["id"]) if m["role"] == "user"]
    assert users == ["Chapter 1\n\nIt was a dark night.\n  Indented.", "One line.", "And a plain one."]
    assert out.count("bot> ") == 3
    monkeypatch.setattr("sys.stdin", io.StringIO('"""\nNever closed\n'))
    code, out, err = _run(capsys, "chat", "--model", model_dir, "--db", db, "--resume", conv["id"])
    assert code == 2 and 'kvchat: error: the input ended inside a message opened with """' in err
    assert len(Store(db).messages(conv["id"])) == 7 and "bot> " not in out


def test_a_text_pasted_into_the_terminal_is_one_message(model_dir, tmp_path):
    """In a terminal the chat reads through readline, which has the terminal mark a paste (bracketed paste): a text
    pasted with its line breaks and blank lines is one message, not one message (and one reply) per line."""
    import pty
    import select

    pytest.importorskip("readline", reason="this Python has no readline: a paste is a message per line")
    db = tmp_path / "kv.db"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvchat.app.cli", "chat", "--model", str(model_dir), "--db", str(db),
                             "--budget", "64", "--max-new-tokens", "3"], stdin=slave, stdout=slave,
                            stderr=subprocess.DEVNULL)
    os.close(slave)

    def until_prompt(seen=b""):
        deadline = time.time() + 120
        while not seen.rstrip().endswith(b"you>") and time.time() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                seen += os.read(master, 4096)
        assert seen.rstrip().endswith(b"you>"), seen
        return seen

    try:
        until_prompt()
        os.write(master, b"\x1b[200~Chapter 1\n\nIt was a dark night.\nThe end.\x1b[201~\r")  # what a terminal sends
        until_prompt()
        os.write(master, b"\x04")  # Ctrl-D: the end of the input
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)
    (conv,) = Store(db).conversations()
    users = [m["text"] for m in Store(db).messages(conv["id"]) if m["role"] == "user"]
    assert users == ["Chapter 1\n\nIt was a dark night.\nThe end."]


def test_ctrl_c_while_a_long_message_is_read_stops_the_read_and_chats_on(model_dir, tmp_path):
    """Ctrl-C while the model still reads a long pasted message stops the read between two chunks (it went on to the
    end, then gave a one-token reply): nothing of the message is kept or stored, and the chat goes on."""
    db = tmp_path / "kv.db"
    proc = subprocess.Popen([sys.executable, "-m", "kvchat.app.cli", "chat", "--model", str(model_dir), "--db", str(db),
                             "--budget", "64", "--max-new-tokens", "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        proc.stdin.write(("The red kite flies over the hill. " * 8000 + "\n").encode())  # ~64,000 tokens
        proc.stdin.flush()
        assert proc.stdout.read(10) == b"you> bot> "  # "bot> ": printed as the message's read begins
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(b"Hello there\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert re.search(r"stopped while reading the message \([\d,]+ of its [\d,]+ tokens read\); nothing of it was kept",
                     err.decode()), err.decode()[-2000:]
    assert out.count(b"bot> ") == 1 and out.endswith(b"you> \n")  # the next message's reply, then the end
    (conv,) = Store(db).conversations()
    assert [m["text"] for m in Store(db).messages(conv["id"]) if m["role"] == "user"] == ["Hello there"]


def test_replay_compare_runs_each_policy_side_by_side_and_stores_nothing(model_dir, tmp_path, capsys):
    """``replay --compare``: every script under each policy with one model load; per-turn lines name the policy, and
    the comparison says how many generated replies are the first policy's: all of them for a budget larger than the
    chat (the full cache's greedy replies, exactly), fewer once the cache evicts, where it stays within its bound."""
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT + [{"user": "And again?"}])
    db = tmp_path / "kv.db"
    run = ["replay", script, script, "--model", model_dir, "--max-new-tokens", 6, "--db", db, "--json",
           "--recall", "off"]
    code, out, err = _run(capsys, *run, "--compare", "full, streaming,h2o", "--budget", 400, "--heavy", 8)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    turns, (last,) = lines[:-1], lines[-1:]
    assert [t["policy"] for t in turns] == ["full"] * 10 + ["streaming"] * 10 + ["h2o"] * 10
    rows = last["compare"]
    assert [r["policy"] for r in rows] == ["full", "streaming", "h2o"] and rows[2]["params"]["heavy"] == 8
    assert all(r["same_replies"] == r["replies_compared"] == r["replies"] == 6 and r["evicted_tokens"] == 0
               for r in rows)
    code, out, err = _run(capsys, *run, "--compare", "full,streaming", "--budget", 48, "--window", 8, "--slack", 6)
    full, streaming = json.loads(out.splitlines()[-1])["compare"]
    assert streaming["evicted_tokens"] > 0 and streaming["max_cache_tokens"] <= 54
    assert streaming["replies_compared"] == 6 and streaming["same_replies"] < 6 and full["evicted_tokens"] == 0
    assert not db.exists() or Store(db).conversations() == []
    code, out, err = _run(capsys, *[a for a in run if a != "--json"], "--compare", "full,streaming", "--budget", 48)
    assert code == 0 and re.search(r"^streaming +10 +\d/4 ", out, re.M) and "replies as full" in out
    # One policy at several budgets: the largest keeps everything (the full cache's replies), the smallest evicts.
    code, out, err = _run(capsys, *run, "--compare", "streaming:400,streaming:48,h2o:48", "--window", 8, "--slack", 6)
    rows = json.loads(out.splitlines()[-1])["compare"]
    assert [(r["label"], r["params"]["budget"]) for r in rows] == [("streaming:400", 400), ("streaming:48", 48),
                                                                    ("h2o:48", 48)]
    assert rows[0]["evicted_tokens"] == 0 and rows[1]["evicted_tokens"] > 0 and rows[1]["same_replies_as"] == \
        "streaming:400" and rows[1]["same_replies"] == streaming["same_replies"]


@pytest.mark.parametrize("flags, message", [
    (("--compare", "streaming"), "--compare takes two or more different policies"),
    (("--compare", "h2o,h2o"), "--compare takes two or more different policies"),
    (("--compare", "full,nope"), "--compare nope: unknown policy 'nope'"),
    (("--compare", "h2o:48,h2o:48"), "--compare takes two or more different policies (or POLICY:BUDGET)"),
    (("--compare", "h2o:64,h2o:lots"), "--compare h2o:lots: budget must be a whole number, got 'lots'"),
    (("--compare", "full:512,h2o"), "--compare full:512: full keeps every token: it takes no budget"),
    (("--compare", "full,h2o", "--policy", "h2o"), "--compare names the policies; leave out --policy"),
    (("--compare", "full,streaming", "--heavy", "8"), "--heavy applies to none of full, streaming"),
    (("--compare", "full,streaming", "--budget", "3"), "--compare streaming: budget (3) must be at least sink"),
    (("--compare", "full,streaming", "--resume", "1"), "--compare replays the scripts as new conversations"),
])
def test_replay_compare_refuses_bad_lists_in_one_line(model_dir, tmp_path, capsys, flags, message):
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT)
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, "--db", tmp_path / "kv.db", *flags)
    assert code == 2 and message in err and "loading" not in err and len(err.strip().splitlines()) == 1, err


def test_replay_compare_goes_on_past_a_policy_that_stops(model_dir, tmp_path, capsys):
    """``full`` cannot pass the model's positions: its row says where it stopped; the other policy runs every
    script to its end, its turns' warnings shown."""
    long = [{"user": f"Turn {i}: " + "tell me more about it. " * 20} for i in range(12)]  # ~1,800 positions
    script = write_jsonl(tmp_path / "long.jsonl", long)
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, "--max-new-tokens", 4, "--compare",
                          "full,window", "--budget", 64, "--positions", "original")
    assert code == 0, err
    assert "warning (window): original positions now pass the model's 512 trained positions" in err
    assert re.search(r"^full stopped at \S*long.jsonl, step \d+: this message needs \d+ more positions", out, re.M), out
    assert re.search(r"^window +12 ", out, re.M) and "window stopped" not in out


def test_a_terminal_shows_how_far_a_long_message_is_read(tiny, capsys, monkeypatch):
    """On a terminal, while a long message is read before its reply, stderr says how far the read got, in one line
    written over in place and wiped when the reply begins (the reply's prompt written again)."""
    from kvchat.app.terminal import stream
    from kvchat.core.engine.session import Sampling, Session
    from kvchat.core.engine.settings import Settings

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    session = Session(tiny("llama"), Settings(policy="h2o", budget=96, window=8, slack=16),
                      sampling=Sampling(max_new_tokens=3, temperature=0.0))

    def slow(ids, *args, **kwargs):
        time.sleep(0.04)
        return type(session).forward(session, ids, *args, **kwargs)

    monkeypatch.setattr(session, "forward", slow)
    monkeypatch.setattr("sys.stderr", Terminal())
    res = stream(session, session.reply("The red kite flies over the hill and the river. " * 60))  # ~40 forwards
    shown = sys.stderr.getvalue()
    lines = re.findall(r"\r\033\[K\[reading your message: ([\d,]+) of ([\d,]+) tokens; Ctrl-C stops it\]", shown)
    read = [int(m.replace(",", "")) for m, _ in lines]
    assert len(read) >= 2 and read == sorted(read) and read[-1] > read[0], shown
    assert len({total for _, total in lines}) == 1, shown  # the message's tokens (not the reply's header after it)
    assert shown.endswith("\r\033[K") and res.new_tokens > 0
    assert capsys.readouterr().out.startswith("bot> ")  # written again where the line was, before the reply
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal: nothing shown
    stream(session, session.reply("The red kite flies over the hill and the river. " * 60))
    assert sys.stderr.getvalue() == ""


def test_cache_flags_given_with_resume_change_the_stored_settings(model_dir, tmp_path, capsys, monkeypatch):
    """``--resume`` with cache flags continues the conversation with its stored settings changed by them, as
    /policy and /set change them (they were ignored without a word); the same command again changes nothing."""
    db = tmp_path / "kv.db"
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT[:3])
    code, _, _ = _run(capsys, "replay", script, "--model", model_dir, "--budget", 64, "--db", db, "--json")
    cid = Store(db).conversations()[0]["id"]

    def chat(*flags, stdin="/quit\n"):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        return _run(capsys, "chat", "--model", model_dir, "--db", db, "--resume", cid, "--max-new-tokens", 3, *flags)

    code, _, err = chat("--policy", "h2o", "--heavy", 8, "--budget", 48, stdin="Hello\n/quit\n")
    assert code == 0 and "changed from its stored settings: policy=h2o, heavy=8" in err, err
    stored = Store(db).conversation(cid)["settings"]
    assert (stored["policy"], stored["params"], stored["budget"]) == ("h2o", {"heavy": 8}, 48)
    code, _, err = chat("--average", "false")  # a parameter alone: the policy's others kept
    assert code == 0 and Store(db).conversation(cid)["settings"]["params"] == {"heavy": 8, "average": False}
    code, _, err = chat("--policy", "h2o", "--budget", 48)
    assert code == 0 and "changed from" not in err
    changes = [c["changes"] for c in Store(db).settings_changes(cid)]
    assert len(changes) == 2 and changes[0]["policy"] == "h2o" and changes[1] == {"params": changes[1]["params"]}
    for flags, message in [(("--obs-window", 4), "--obs-window does not apply to policy h2o"),
                           (("--window", 100), "budget (48) must be at least sink + window (4 + 100)"),
                           (("--system", "Be brief."), "--system starts a new conversation")]:
        code, _, err = chat(*flags)
        assert code == 2 and message in err, (flags, err)
    assert Store(db).conversation(cid)["settings"] == {**stored, "params": {"heavy": 8, "average": False}}
    # replay --resume takes them alike
    longer = write_jsonl(tmp_path / "s2.jsonl", SCRIPT[:3] + [{"user": "Hello"}, {"user": "And again?"}])
    code, _, err = _run(capsys, "replay", longer, "--model", model_dir, "--db", db, "--resume", cid, "--json",
                        "--budget", 40, "--max-new-tokens", 3)
    assert code == 0 and "changed from its stored settings: budget=40" in err, err
    assert Store(db).conversation(cid)["settings"]["budget"] == 40


def test_a_conversation_open_in_one_process_is_refused_to_another(model_dir, tmp_path, capsys, monkeypatch):
    """Two processes with one conversation open wrote turns on top of each other's state: the second's turn files
    were renamed or removed under the first (its reply failed, lost), and a delete from another command removed
    the folder under a running chat. While a process has a conversation open, another's resume, delete or rename
    is refused in one line naming it; the system gives it back when that process ends, however it ends."""
    db = tmp_path / "kv.db"
    code, _, _ = _run(capsys, "replay", write_jsonl(tmp_path / "s.jsonl", SCRIPT[:3]), "--model", model_dir, "--db", db,
                      "--budget", 64, "--json")
    cid = Store(db).conversations()[0]["id"]
    held = Store(db).archive_folder(Store(db).conversation(cid)["archive"]) / "held"

    def holder():  # a terminal chat on the conversation, waiting at its prompt
        proc = subprocess.Popen([sys.executable, "-m", "kvchat.app.cli", "chat", "--model", str(model_dir), "--db",
                                 str(db), "--resume", str(cid), "--max-new-tokens", "3"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(600):
            if held.is_file() and held.read_text().split("\n")[:2] == [str(proc.pid), "kvchat chat"]:
                return proc
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.kill()
        raise AssertionError("the chat did not open the conversation in 120 s")

    def chat(stdin="Hello\n"):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        return _run(capsys, "chat", "--model", model_dir, "--db", db, "--resume", cid, "--max-new-tokens", 3)

    first = holder()
    try:
        refusal = (f"conversation {cid} is open in another kvchat process (pid {first.pid}, `kvchat chat`); close it "
                   "there first")
        for code, _, err in [chat(), _run(capsys, "conversations", "delete", cid, "--db", db),
                             _run(capsys, "conversations", "rename", cid, "Other", "--db", db),
                             _run(capsys, "replay", tmp_path / "s.jsonl", "--model", model_dir, "--db", db,
                                  "--resume", cid)]:
            assert code == 2 and refusal in err, err
        broken = tmp_path / "broken"  # a model folder that passes the early look but would not load
        broken.mkdir()
        (broken / "config.json").write_text("{}")
        for command in ("chat", "replay"):  # refused before a model loads: this one would not
            code, _, err = _run(capsys, command, *([tmp_path / "s.jsonl"] if command == "replay" else []), "--model",
                                broken, "--db", db, "--resume", cid)
            assert code == 2 and refusal in err and "loading" not in err, err
        out, err = first.communicate("And you?\n", timeout=120)  # the holder's turn goes on and is stored
        assert first.returncode == 0, err
    finally:
        first.kill()
    conv = Store(db).conversation(cid)
    assert conv["title"] != "Other" and len(Store(db).messages(cid)) == 5
    code, _, err = chat()  # closed there: open here
    assert code == 0 and len(Store(db).messages(cid)) == 7, err
    second = holder()
    second.kill()  # kill -9: nothing is left to clear
    second.wait()
    code, _, err = _run(capsys, "conversations", "delete", cid, "--db", db)
    assert code == 0 and Store(db).conversations() == [], err


def test_a_resume_of_no_stored_conversation_is_refused_before_the_model_loads(tmp_path, capsys):
    """A mistyped id or --db: the one-line error at once, not after the model's load (seconds), and no empty
    database left where --db named none."""
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT[1:2])
    Store(tmp_path / "kv.db").conversations()  # a database without conversations
    for db in (tmp_path / "kv.db", tmp_path / "typo.db"):
        for command in ("chat", "replay"):
            code, _, err = _run(capsys, command, *([script] if command == "replay" else []), "--model",
                                "./does/not/exist", "--db", db, "--resume", 3)
            lines = [x for x in err.splitlines() if x.startswith("kvchat: error:")]
            assert code == 2 and lines == [f"kvchat: error: no conversation 3 in {db}"] and "loading" not in err, err
    assert not (tmp_path / "typo.db").exists()


def test_a_resume_takes_the_conversations_own_model_and_refuses_another_before_loading(model_dir, tmp_path, capsys,
                                                                                         monkeypatch):
    """``--resume`` without ``--model`` reopens with the model that held the conversation (it loaded the default
    model, then refused); a ``--model`` naming another is refused at once, not after loading it."""
    db = tmp_path / "kv.db"
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT[:2])
    code, _, err = _run(capsys, "replay", script, "--model", model_dir, "--db", db, "--budget", 64,
                        "--max-new-tokens", 3, "--json")
    assert code == 0, err
    cid = Store(db).conversations()[0]["id"]
    held = len(Store(db).messages(cid))
    monkeypatch.setattr("sys.stdin", io.StringIO("One more\n/quit\n"))
    code, out, err = _run(capsys, "chat", "--db", db, "--resume", cid, "--max-new-tokens", 3)
    assert code == 0 and f"loading {model_dir} ..." in err and out.count("bot> ") == 1, err
    for command in ("chat", "replay"):
        code, _, err = _run(capsys, command, *([script] if command == "replay" else []), "--model", "./other",
                            "--db", db, "--resume", cid)
        assert code == 2 and f"conversation {cid} was held by model {model_dir}, not ./other" in err, err
        assert "loading" not in err
    assert len(Store(db).messages(cid)) == held + 2


def test_a_model_given_by_a_relative_path_resumes_from_another_folder(model_dir, tmp_path, capsys, monkeypatch):
    """A conversation stores the absolute path of a local ``--model`` (it stored ``./tiny``, which only its own folder
    could load): it resumes from elsewhere without ``--model``, or with the same model named by another path."""
    db = tmp_path / "kv.db"
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT[1:2])
    monkeypatch.chdir(model_dir.parent)
    code, _, err = _run(capsys, "replay", script, "--model", f"./{model_dir.name}", "--db", db, "--budget", 64,
                        "--max-new-tokens", 3, "--json")
    assert code == 0, err
    cid = Store(db).conversations()[0]["id"]
    assert Store(db).conversation(cid)["model"] == str(model_dir)
    monkeypatch.chdir(tmp_path)
    for model in ([], ["--model", model_dir], ["--model", os.path.relpath(model_dir)]):
        monkeypatch.setattr("sys.stdin", io.StringIO("One more\n/quit\n"))
        code, out, err = _run(capsys, "chat", "--db", db, "--resume", cid, "--max-new-tokens", 3, *model)
        assert code == 0 and out.count("bot> ") == 1, err
    with sqlite3.connect(db) as con:  # as an older kvchat stored it: resumes from its own folder, by either path
        con.execute("UPDATE conversations SET model = ? WHERE id = ?", (f"./{model_dir.name}", cid))
    monkeypatch.chdir(model_dir.parent)
    for model in ([], ["--model", model_dir]):
        monkeypatch.setattr("sys.stdin", io.StringIO("One more\n/quit\n"))
        code, out, err = _run(capsys, "chat", "--db", db, "--resume", cid, "--max-new-tokens", 3, *model)
        assert code == 0 and out.count("bot> ") == 1, err


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "kvchat"  # the environment's console script, not whatever is on PATH
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("kvchat ")


def test_sharegpt_and_mt_bench_formats(tmp_path):
    mt = load_scripts(data_file("streaming-llm", "mt_bench.jsonl"))
    assert len(mt) == 1 and len(mt[0].steps) == 158 and all(s.kind == "reply" for s in mt[0].steps)
    convs = load_scripts(data_file("fastchat", "dummy_conversation.json"))
    assert len(convs) == 500 and convs[0].steps[0].kind == "exchange"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"conversations": [{"from": "alien", "value": "x"}]}))
    with pytest.raises(ScriptError, match="conversations\\[0\\]"):
        load_scripts(bad)


@pytest.fixture
def param_policy():
    """A policy with declared parameters, registered for one test."""
    from kvchat.policies import POLICIES, Param, Policy, register

    @register
    class Oldest(Policy):
        name = "oldest-test"
        summary = "keeps the oldest tokens (test only)"
        params = (Param("keep_bias", float, 1.0, "weight of age", min=0.0),
                  Param("mode_x", str, "a", "a mode", choices=("a", "b")))

        def score(self, view):
            return -view.positions.float() * self.keep_bias

    yield Oldest
    del POLICIES["oldest-test"]


def test_policy_parameters_become_flags(param_policy, model_dir, tmp_path, capsys):
    from kvchat.app.args import build_parser, settings_from_args

    args = build_parser().parse_args(["replay", "x.jsonl", "--policy", "oldest-test", "--keep-bias", "2.5",
                                      "--budget", "256"])
    settings = settings_from_args(args)
    assert settings.params == {"keep_bias": 2.5}  # parsed by its declaration
    settings.validate(512)
    code, out, _ = _run(capsys, "policies")
    assert "--keep-bias (float, default 1.0): weight of age" in out
    script = write_jsonl(tmp_path / "s.jsonl", SCRIPT[1:3])
    code, _, err = _run(capsys, "replay", script, "--model", model_dir, "--policy", "streaming", "--keep-bias", 2)
    assert code == 2 and "--keep-bias does not apply to policy streaming" in err
    code, _, err = _run(capsys, "replay", script, "--model", model_dir, "--policy", "oldest-test", "--mode-x", "c")
    assert code == 2 and "mode_x must be one of a, b" in err
    code, out, _ = _run(capsys, "replay", script, "--model", model_dir, "--policy", "oldest-test", "--keep-bias",
                        "0.5", "--budget", 48, "--window", 8, "--no-save", "--json")
    assert code == 0 and json.loads(out.splitlines()[-1])["summary"]["params"]["keep_bias"] == 0.5


def test_help_shows_each_value_kind_and_default(capsys):
    from kvchat.app.args import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["replay", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "PARAM_" not in out
    for usage in ("--heavy INT", "--pool {max,avg}", "--budget INT", "--window INT", "--groups {token,sentence,turn}",
                  "--temperature FLOAT", "--top-k INT", "--repetition-penalty FLOAT", "--average BOOL"):
        assert f"[{usage}]" in out, usage
    assert "(policies: h2o; default 0)" in out and "(default budget/4)" in out
    assert "(default 0.7 unless the model sets its own)" in out  # replay samples as a chat would


def test_sampling_flags_are_left_to_the_model_unless_given():
    from kvchat.app.args import build_parser, sampling_from_args, settings_from_args
    from kvchat.core.engine.settings import Sampling, Settings

    args = build_parser().parse_args(["chat"])
    assert sampling_from_args(args) == {} and settings_from_args(args) == Settings()
    args = build_parser().parse_args(["replay", "x.jsonl", "--top-k", "40", "--min-p", "0.05", "--window", "",
                                      "--budget", "256"])
    assert sampling_from_args(args) == {"top_k": 40, "min_p": 0.05}
    assert settings_from_args(args).window is None and settings_from_args(args).budget == 256
    assert not Sampling().changed(**sampling_from_args(args)).greedy  # a replay samples as a chat would
    greedy = build_parser().parse_args(["replay", "x.jsonl", "--temperature", "0"])
    assert Sampling().changed(**sampling_from_args(greedy)).greedy
    for bad, message in ((["--top-k", "x"], "top_k must be a whole number"), (["--budget", "0"], "budget must be >= 1"),
                         (["--groups", "word"], "groups must be one of token, sentence, turn")):
        with pytest.raises(ValueError, match=message):
            a = build_parser().parse_args(["chat", *bad])
            settings_from_args(a), sampling_from_args(a)


def test_chat_set_changes_cache_and_sampling_settings(tiny, capsys):
    from kvchat.app.terminal import CHAT_HELP, _chat_command
    from kvchat.core.engine.session import Session
    from kvchat.core.engine.settings import CACHE_SETTINGS, SAMPLING_SETTINGS, Settings

    for p in (*CACHE_SETTINGS, *SAMPLING_SETTINGS):
        assert f"  {p.name}={p.kind}" in CHAT_HELP
    session = Session(tiny("llama"), Settings(budget=64, window=8), system=None)
    _chat_command(session, "/set temperature=0.3 top_k=40 groups=sentence window=")
    out = capsys.readouterr().out
    assert session.sampling.temperature == 0.3 and session.sampling.top_k == 40
    assert session.settings.groups == "sentence" and session.settings.window is None
    assert "temperature=0.3" in out and "groups=sentence" in out
    before = (session.settings, session.sampling)
    for line, message in (("/set top_k=-1 sink=2", "top_k must be >= 0"),
                          ("/set sink=2 temperature=hot", "temperature must be a finite number"),
                          ("/set temperature=0.1 window=100", "must be at least sink \\+ window"),
                          ("/set colour=red", "cannot change 'colour'"),
                          ("/set policy=nope", "unknown policy 'nope'"),
                          ("/set top_k=-1 colour=red temperature=hot sink=2", "^top_k must be >= 0.*; /set cannot "
                           "change 'colour'.*; temperature must be a finite number"),
                          ("/policy h2o heavy=x bogus=1 average=yes", "^heavy must be a whole number, got 'x'; "
                           "policy h2o has no parameter bogus$")):
        with pytest.raises(ValueError, match=message):
            _chat_command(session, line)
        assert (session.settings, session.sampling) == before, line
    _chat_command(session, "/set temperature=0.3")
    assert "no change" in capsys.readouterr().out
    session.chat("Hello there")
    _chat_command(session, "/stats")  # as a person reads it: sizes in MiB, counts with separators, key=value
    out = capsys.readouterr().out
    nbytes = session.stats()["cache_bytes"]
    assert f"  cache_bytes: {nbytes / 2**20:,.1f} MiB ({nbytes:,} bytes)\n" in out
    assert "  settings: policy=streaming, budget=64, sink=4, window=16, " in out


@pytest.fixture
def default_sigint():
    """Ctrl-C as a terminal delivers it (KeyboardInterrupt), however pytest was started: a job that a non-interactive
    shell puts in the background starts with SIGINT ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("decode", ["auto", "graph"])  # graph: the step that runs ahead of the host (a GPU's)
def test_ctrl_c_in_the_terminal_chat_stops_the_reply_and_keeps_it(decode, tokenizer, tmp_path, monkeypatch, capsys,
                                                                  default_sigint):
    """Ctrl-C while a reply streams (here: SIGINT sent while the fifth token is read back) stops it between two
    tokens: its turn is closed and saved with the partial reply, the cache, token log and next positions agree, the
    next message is answered, and Ctrl-C means KeyboardInterrupt again after the reply. It used to raise inside a
    model step and leave the turn open: never saved, the cache and the log apart."""
    import os
    import signal

    from kvchat.app.terminal import stream
    from kvchat.core.engine import sampling
    from kvchat.core.engine.session import Sampling, Session
    from kvchat.core.engine.settings import Settings
    from kvchat.core.model.loading import ChatModel

    model = ChatModel.from_pretrained_model(build_tiny("llama", tokenizer), tokenizer, name="tiny", decode=decode)
    store = Store(tmp_path / "kv.db")
    session = Session(model, Settings(policy="h2o", budget=48, window=8, slack=8, recall="off"), store=store,
                      sampling=Sampling(max_new_tokens=30, temperature=0.0))
    session.chat("Hello there")
    read, reads = sampling.Sampler.read, []

    def read_interrupted(self):
        reads.append(1)
        if len(reads) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return read(self)

    monkeypatch.setattr(sampling.Sampler, "read", read_interrupted)
    res = stream(session, session.reply("Tell me about the sea"))
    assert res.stopped == "cancelled" and 4 <= res.new_tokens <= 6 and session.history[-1] is res
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    positions = session.kept_positions()
    assert int(positions.max()) == session.log.n - 1 and session.cache.length == session.cache.layers[0].lens[0]
    monkeypatch.setattr(sampling.Sampler, "read", read)
    assert session.chat("And then?").new_tokens > 0
    messages = store.messages(session.conversation_id)
    assert [m["role"] for m in messages][-4:] == ["user", "assistant", "user", "assistant"]
    assert messages[-3]["text"] == res.answer and res.answer
    capsys.readouterr()


def test_undo_and_retry_in_the_terminal_chat(model_dir, tmp_path, monkeypatch, capsys):
    """``/undo`` takes the last exchange back (its message shown again; the stored conversation loses it) and
    ``/retry`` answers its message again (greedy: the same reply, stored once); once only, and not with --no-undo."""
    from kvchat.app.args import build_parser
    from kvchat.app.terminal import cmd_chat

    def chat(db, lines, *flags):
        feed = iter(lines)
        monkeypatch.setattr("builtins.input", lambda prompt="": next(feed))
        args = build_parser().parse_args(["chat", "--model", str(model_dir), "--db", str(db), "--budget", "48",
                                          "--window", "8", "--max-new-tokens", "6", "--temperature", "0", *flags])
        assert cmd_chat(args) == 0
        return capsys.readouterr()

    db = tmp_path / "kv.db"
    out, err = chat(db, ["My cat is called Pixel.", "/undo", "/undo", "Tell me about the sea", "/retry", "/retry x",
                         "/quit"])
    assert "taken back: your message and its reply; the cache is as it was before them. It was:\n  My cat is " \
           "called Pixel." in out
    assert "kvchat: error: nothing to undo: only the last reply of this chat can be taken back, once" in err
    assert "kvchat: error: /retry takes nothing after it" in err
    replies = out.split("bot> ")[1:]  # each reply's line ends on stderr, with its numbers
    assert len(replies) == 3 and replies[1] == replies[2] != ""
    (conv,) = Store(db).conversations()
    stored = [(m["role"], m["text"]) for m in Store(db).messages(conv["id"]) if m["role"] != "system"]
    assert [role for role, _ in stored] == ["user", "assistant"] and stored[0][1] == "Tell me about the sea"
    out, err = chat(tmp_path / "other.db", ["Hello", "/retry", "/quit"], "--no-undo")
    assert "kvchat: error: nothing to retry: this chat keeps no undo copy (--no-undo)" in err
    assert out.count("bot> ") == 1


def test_a_reply_that_fails_midway_in_the_terminal_chat_reopens_and_goes_on(model_dir, tmp_path, monkeypatch, capsys):
    """``kvchat chat``: a model step that raises mid-reply (out of GPU memory, say) is a one-line error, the
    conversation is reopened at its last saved turn, and the next message is answered and saved; it used to end
    the program with a traceback."""
    from kvchat.app.args import build_parser
    from kvchat.app.terminal import cmd_chat
    from kvchat.core.engine import sampling

    db = tmp_path / "kv.db"
    lines = iter(["Hello there", "Tell me about the sea", "And then?", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    read, reads = sampling.Sampler.read, []

    def read_failing(self):
        reads.append(1)
        if len(reads) == 8:  # the second reply's third token
            raise RuntimeError("CUDA out of memory (simulated)")
        return read(self)

    monkeypatch.setattr(sampling.Sampler, "read", read_failing)
    args = build_parser().parse_args(["chat", "--model", str(model_dir), "--db", str(db), "--budget", "48",
                                      "--window", "8", "--max-new-tokens", "5"])
    assert cmd_chat(args) == 0
    err = capsys.readouterr().err
    assert "kvchat: error: the reply failed (RuntimeError: CUDA out of memory (simulated)); the conversation was " \
           "reopened at its last saved turn" in err
    (conv,) = Store(db).conversations()
    texts = [m["text"] for m in Store(db).messages(conv["id"]) if m["role"] == "user"]
    assert texts == ["Hello there", "And then?"]
