"""A replay script's set lines (``{"set": {...}}``): settings changed where the line stands, as ``/policy`` and
``/set`` change them in a chat; checked before anything runs; applied again by ``--resume`` so the interrupted
command, ``--resume`` added, goes on as the uninterrupted run did; the same for every entry of ``--compare``."""

import json

import pytest

from kvchat.app.cli import main
from kvchat.app.replay import run_step
from kvchat.app.scripts import ScriptError, load_scripts
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model import loading as models
from kvchat.storage.db import Store

from helpers import write_jsonl

FLAGS = ["--policy", "streaming", "--budget", "48", "--window", "8", "--slack", "6", "--recall", "off",
         "--temperature", "0", "--max-new-tokens", "6"]
START = Settings(policy="streaming", budget=48, window=8, slack=6, recall="off")
SWITCH = {"policy": "h2o", "heavy": 8, "budget": 40, "max_new_tokens": 4}
LINES = [{"system": "You are terse."}]
for i in range(3):
    LINES += [{"user": f"Fact {i}: the box number {i} is painted blue. Remember it."},
              {"assistant": f"Noted: box {i} is blue. I will remember it."}]
LINES += [{"set": SWITCH}, {"user": "Which boxes are blue?"}, {"user": "Tell me about box 1."},
          {"set": {"heavy": 4}}, {"user": "And box 2?"}]
SET_AT = 8  # the first set line's line number


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def _reference(model_dir, script):
    """The generated replies of the chat the script describes, in a live session whose settings ``configure`` and
    the sampling settings change where the set lines stand."""
    model = models.load(str(model_dir))
    session = Session(model, START, system="You are terse.", sampling=Sampling.for_model(
        model, temperature=0.0, max_new_tokens=6))
    replies = []
    for step in load_scripts(script)[0].steps:
        if step.kind == "set" and "policy" in step.cache:
            session.configure(policy="h2o", budget=40, params={"heavy": 8})
            session.sampling = session.sampling.changed(max_new_tokens=4)
        elif step.kind == "set":
            session.configure(params={"heavy": 4})
        elif step.kind == "reply":
            replies.append(run_step(session, step, {}).answer)
        else:
            run_step(session, step, {})
    session.close()
    return replies


def test_a_set_line_changes_the_settings_where_it_stands_as_the_chat_does(model_dir, tmp_path, capsys):
    """The replay's generated replies are those of a live session whose settings were changed at the same points;
    the set lines print what changed and are stored as the conversation's settings changes."""
    script = write_jsonl(tmp_path / "s.jsonl", LINES)
    db = tmp_path / "kv.db"
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, "--db", db, "--json", *FLAGS)
    assert code == 0, err
    sets = [line for line in out if "set" in line]
    assert sets[0] == {"script": str(script), "line": f"{script}:{SET_AT}",
                       "set": {"policy": "h2o", "params": {"heavy": 8}, "budget": 40, "max_new_tokens": 4}}
    assert sets[1]["set"] == {"params": {"heavy": 4}}
    turns = [line for line in out if "turn" in line]
    assert [t["answer"] for t in turns[3:]] == _reference(model_dir, script)
    assert all(t["new_tokens"] <= 4 for t in turns[3:]) and turns[-1]["cache_tokens"] <= 40 + 6
    summary = out[-1]["summary"]
    assert summary["policy"] == "h2o" and summary["params"]["heavy"] == 4 and summary["params"]["budget"] == 40
    store = Store(db)
    (conv,) = store.conversations()
    changes = store.settings_changes(conv["id"])
    assert [(c["turn"], c["changes"].get("policy")) for c in changes] == [(4, "h2o"), (6, None)]


def test_a_set_line_in_the_table_output(model_dir, tmp_path, capsys):
    script = write_jsonl(tmp_path / "s.jsonl", LINES)
    code = main(["replay", str(script), "--model", str(model_dir), "--no-save", *FLAGS])
    err = capsys.readouterr().err
    assert code == 0 and f"set at {script}:{SET_AT}: policy=h2o, heavy=8, budget=40, max_new_tokens=4" \
        in err


@pytest.mark.parametrize("lines, message", [
    ([{"user": "Hi."}, {"set": {}}], ":2: \"set\" takes an object of settings"),
    ([{"user": "Hi."}, {"set": 5}], ":2: \"set\" takes an object of settings"),
    ([{"user": "Hi."}, {"set": {"budget": 64}, "user": "x"}], ":2: a set line has only \"set\""),
    ([{"user": "Hi."}, {"set": {"bugdet": 64}}], ":2: unknown setting 'bugdet'"),
    ([{"user": "Hi."}, {"set": {"policy": "nope"}}], ":2: unknown policy 'nope'"),
    ([{"user": "Hi."}, {"set": {"policy": "streaming", "heavy": 8}}], ":2: heavy is a parameter of h2o, not of "
                                                                     "streaming"),
    ([{"user": "Hi."}, {"set": {"budget": -5}}], ":2: budget must be"),
    ([{"user": "Hi."}, {"set": {"temperature": "warm"}}], ":2: temperature must be"),
    ([{"user": "Hi."}, {"set": {"budget": -5, "bugdet": 6, "temperature": "warm"}}],
     ":2: budget must be >= 1, got -5; unknown setting 'bugdet' (kvchat replay --help lists them); temperature must "
     "be a finite number, got 'warm'"),
    ([{"user": "Hi."}, {"set": {"budget": 64}}, {"assistant": "Hello."}], ":2: a set line parts a user line from "
                                                                         "its assistant line"),
    ([{"set": {"budget": 64}}], ": the script has no turns"),
    ([{"set": {"budget": 64}}, {"system": "Terse."}, {"user": "Hi."}], ":2: a system line stands alone"),
])
def test_a_bad_set_line_is_refused_naming_it(tmp_path, lines, message):
    with pytest.raises(ScriptError) as err:
        load_scripts(write_jsonl(tmp_path / "s.jsonl", lines))
    assert message in str(err.value)


@pytest.mark.parametrize("setting, message", [
    ({"heavy": 8}, ":3: policy streaming (running there) has no parameter heavy"),
    ({"budget": 10}, ":3: budget (10) must be at least sink + window (4 + 8)"),
    ({"policy": "tova", "positions": "original"}, None),
])
def test_a_set_line_that_cannot_run_where_it_stands_stops_the_replay_before_it_starts(
        model_dir, tmp_path, capsys, setting, message):
    """Checked in the settings the line meets, after the model loads and before a turn runs or is stored."""
    script = write_jsonl(tmp_path / "s.jsonl", [{"user": "Hi."}, {"assistant": "Hello."}, {"set": setting},
                                                {"user": "Bye."}])
    db = tmp_path / "kv.db"
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, "--db", db, "--json", *FLAGS)
    if message is None:  # the last one runs: tova, the kept keys at the positions they were computed at
        assert code == 0, err
        return
    error = [line for line in err.splitlines() if line.startswith("kvchat: error:")]
    assert code == 2 and len(error) == 1 and message in error[0], err
    assert not db.exists() or Store(db).conversations() == []


@pytest.mark.parametrize("cut", [3, 4, 5])
def test_an_interrupted_replay_resumed_goes_on_in_the_settings_its_set_lines_made(model_dir, tmp_path, capsys, cut):
    """Stored up to turn ``cut`` (before the first set line, just after it, a turn after it), then resumed with the
    whole script and the first run's flags: no setting is changed from the stored ones, the set lines not yet
    reached are applied, and the replies and the end's settings are the uninterrupted run's."""
    script = write_jsonl(tmp_path / "s.jsonl", LINES)
    whole = tmp_path / "whole.db"
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, "--db", whole, "--json", *FLAGS)
    assert code == 0, err
    expected = [t["answer"] for t in out if "turn" in t]
    steps = load_scripts(script)[0].steps
    done = [i for i, s in enumerate(steps) if s.turn][cut - 1] + 1  # the steps up to the cut-th turn
    lines = 1 + sum(2 if s.kind == "exchange" else 1 for s in steps[:done])  # the system line, the steps' lines
    short = write_jsonl(tmp_path / "short.jsonl", LINES[:lines])
    db = tmp_path / "kv.db"
    assert _run(capsys, "replay", short, "--model", model_dir, "--db", db, "--json", *FLAGS)[0] == 0
    cid = Store(db).conversations()[0]["id"]
    code, out, err = _run(capsys, "replay", script, "--model", model_dir, "--db", db, "--resume", cid, "--json",
                          *FLAGS)
    assert code == 0, err
    assert "changed from its stored settings" not in err
    assert [t["answer"] for t in out if "turn" in t] == expected[cut:]
    assert len([line for line in out if "set" in line]) == (2 if cut < 4 else 1)
    assert out[-1]["summary"]["policy"] == "h2o" and out[-1]["summary"]["params"]["heavy"] == 4
    assert Store(db).conversation(cid)["settings"] == Store(whole).conversations()[0]["settings"]


def test_compare_applies_a_set_line_to_every_policy_and_refuses_one_that_switches_policy(model_dir, tmp_path,
                                                                                          capsys):
    lines = [line for line in LINES if "set" not in line]
    lines.insert(7, {"set": {"budget": 32, "max_new_tokens": 3}})
    script = write_jsonl(tmp_path / "s.jsonl", lines)
    run = ["replay", script, "--model", model_dir, "--json", "--window", 8, "--slack", 6, "--recall", "off",
           "--max-new-tokens", 6]
    code, out, err = _run(capsys, *run, "--compare", "streaming:64,h2o:48", "--heavy", 8)
    assert code == 0, err
    rows = out[-1]["compare"]
    assert [r["params"]["budget"] for r in rows] == [32, 32] and all(r["max_cache_tokens"] <= 64 + 6 for r in rows)
    assert all(t["new_tokens"] <= 3 for t in out[:-1] if t["turn"] > 3)
    assert all(t["cache_tokens"] <= 32 + 6 for t in out[:-1] if t["turn"] > 3)
    script = write_jsonl(tmp_path / "s.jsonl", LINES)
    code, _, err = _run(capsys, *run, "--compare", "streaming:64,h2o:48")
    assert code == 2 and f"--compare streaming:64: {script}:{SET_AT}: --compare runs each policy it lists" in err, \
        err


@pytest.mark.parametrize("new", [
    Settings(policy="h2o", params={"heavy": 8}),
    Settings(policy="streaming", budget=64),
    Settings(policy="h2o", params={"heavy": 16}, budget=64, window=8),
    Settings(policy="snapkv", recall="off", slack=5),
])
def test_changes_to_makes_the_settings_given(new):
    """What a resumed replay asks ``configure`` for: from any settings, exactly ``new`` (a parameter back at its
    default too)."""
    for old in (Settings(), Settings(policy="h2o", params={"heavy": 4, "average": False}, budget=256)):
        assert old.changed(**old.changes_to(new)) == new
        assert new.changes_to(new) == {}
