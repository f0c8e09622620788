"""Kill -9, twenty times: a replay killed at random moments (mid-prefill, mid-decode, mid-compression,
mid-commit) and continued with ``--resume`` loses no completed turn, keeps no half turn, reopens with exactly the
cache an uninterrupted run had after the same turn, and ends with the uninterrupted run's answers."""

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

from kvchat.app.cli import main
from kvchat.app.replay import run_step
from kvchat.app.scripts import load_scripts
from kvchat.core.model import loading as models
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.storage.db import Store

FLAGS = ["--policy", "h2o", "--budget", "48", "--window", "8", "--slack", "6", "--groups", "sentence",
         "--max-new-tokens", "10"]
SETTINGS = Settings(policy="h2o", budget=48, window=8, slack=6, groups="sentence")
KILLS = 20
CALIBRATION_TURNS = 8  # turns of a first run timed (then it is killed) to aim the kills at a turn's moments
STEPS = 90  # more than twenty kills can get through, so every kill lands in a run with turns left


def _script(path):
    lines = [{"system": "You are terse."}]
    for i in range(STEPS):
        if i % 3 == 2:
            lines.append({"user": f"Question {i}: what comes after {i}? Answer briefly."})
        else:
            lines += [{"user": f"Fact {i}: the box number {i} is painted a colour. Remember it."},
                      {"assistant": f"Noted: box {i} has a colour. I will remember it."}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def _cache_state(session):
    state = {k: t.clone() for k, t in session.cache.state_tensors().items()}
    if session.observer is not None:
        state.update({k: t.clone() for k, t in session.observer.state_tensors().items()})
    return state


def _reference(model_dir, script_path, tmp_path):
    """The uninterrupted run, in this process, with what the CLI would build: per turn, answers and cache. The
    replies are sampled (the model's defaults), so the sampler's generator has to come back exactly too."""
    model = models.load(str(model_dir))
    (script,) = load_scripts(script_path)
    session = Session(model, SETTINGS, system=script.system, store=Store(tmp_path / "reference.db"),
                      sampling=Sampling.for_model(model, max_new_tokens=10), seed=0,
                      title=script_path.name)
    turns = [(session.turn, _cache_state(session), None)]
    for step in script.steps:
        res = run_step(session, step, {})
        turns.append((session.turn, _cache_state(session), res.answer))
    return model, {t: (state, answer) for t, state, answer in turns}


def _stored(db, cid):
    store = Store(db)
    try:
        return store.conversation(cid), store.messages(cid), store.turn_stats(cid)
    finally:
        store.close()


def _replay(model_dir, script, db, cid):
    args = [sys.executable, "-m", "kvchat.app.cli", "replay", str(script), "--model", str(model_dir), "--db", str(db),
            "--json", *FLAGS] + (["--resume", str(cid)] if cid is not None else [])
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _conversation_id(db):
    if not db.exists():
        return None
    with sqlite3.connect(db) as con:
        row = con.execute("SELECT id FROM conversations").fetchone()
    return row[0] if row else None


@pytest.mark.slow
def test_kill_9_twenty_times(model_dir, tmp_path):
    script = _script(tmp_path / "chat.jsonl")
    model, reference = _reference(model_dir, script, tmp_path)
    last_turn = max(reference)
    db = tmp_path / "killed.db"
    rng = random.Random(0)
    proc, started, stamps = _replay(model_dir, script, db, None), time.perf_counter(), []
    for _ in proc.stdout:  # the start of a run: how long until the first turn, how long a turn takes
        stamps.append(time.perf_counter() - started)
        if len(stamps) == CALIBRATION_TURNS:
            break
    assert len(stamps) == CALIBRATION_TURNS, proc.stderr.read()
    proc.kill()
    proc.wait()
    first, per_turn = stamps[0], (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    for path in tmp_path.glob("killed.db*"):
        path.unlink()
    kills, seen_turns = 0, []
    while kills < KILLS:
        proc = _replay(model_dir, script, db, _conversation_id(db))
        if rng.random() < 0.15:  # while it starts and loads
            time.sleep(rng.uniform(0, first))
        else:  # a random moment of one of its first turns: let 0-2 turns complete, then part of another
            for _ in range(rng.randrange(3)):
                proc.stdout.readline()
            time.sleep(rng.uniform(0, 1.5 * per_turn))
        assert proc.poll() is None, "the run ended before its kill; make the script longer"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        with sqlite3.connect(db) as con:
            assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        cid = _conversation_id(db)
        if cid is None:
            continue  # killed before the first exchange committed: nothing to keep yet
        conv, messages, stats = _stored(db, cid)
        turn = conv["next_turn"]
        seen_turns.append(turn)
        assert len(stats) == turn and {m["turn"] for m in messages} == set(range(turn))  # no half turn
        for m in messages:  # every stored reply is the uninterrupted run's
            if m["role"] == "assistant":
                assert m["text"] == reference[m["turn"] + 1][1], f"turn {m['turn']}"
        reopened = Session.resume(model, Store(db), cid, sampling=Sampling(temperature=0.0, max_new_tokens=10))
        assert reopened.restored_from == "archive"
        expected, _ = reference[turn]
        got = _cache_state(reopened)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"after turn {turn}: {key}"
        reopened.close()
    proc = _replay(model_dir, script, db, _conversation_id(db))  # the rest, uninterrupted
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    conv, messages, stats = _stored(db, _conversation_id(db))
    assert conv["next_turn"] == last_turn
    answers = [m["text"] for m in messages if m["role"] == "assistant"]
    assert answers == [reference[t][1] for t in sorted(reference) if reference[t][1] is not None]
    assert len(set(seen_turns)) > 10, seen_turns  # the kills landed at many different turns


def test_resume_refuses_a_script_that_differs(model_dir, tmp_path, capsys):
    script = _script(tmp_path / "chat.jsonl")
    db = tmp_path / "kv.db"
    lines = script.read_text().splitlines()
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(lines[:5]) + "\n")
    assert main(["replay", str(short), "--model", str(model_dir), "--db", str(db), "--json", *FLAGS]) == 0
    capsys.readouterr()
    cid = _conversation_id(db)
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join(lines[:3] + [json.dumps({"user": "Something else entirely."})] + lines[4:]) + "\n")
    code = main(["replay", str(changed), "--model", str(model_dir), "--db", str(db), "--resume", str(cid), *FLAGS])
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith("kvchat: error:")]
    assert code == 2 and len(error) == 1 and "differs from the script's step 2" in error[0]
    code = main(["replay", str(script), "--model", str(model_dir), "--db", str(db), "--resume", str(cid), "--json",
                 *FLAGS])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    turns = [json.loads(line) for line in out if '"turn"' in line and "summary" not in line]
    assert turns[0]["turn"] == 3 and _stored(db, cid)[0]["next_turn"] == turns[-1]["turn"] + 1


def test_sigterm_ends_a_replay_through_its_cleanup(model_dir, tmp_path):
    """SIGTERM (``timeout``, ``kill``, a service manager's stop) ends ``kvchat replay`` through its cleanup instead
    of on the spot: exit status 143, and an unsaved replay's temporary archive is gone (it was left in /tmp)."""
    script = _script(tmp_path / "chat.jsonl")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    args = [sys.executable, "-m", "kvchat.app.cli", "replay", str(script), "--model", str(model_dir), "--json",
            "--no-save", "--db", str(tmp_path / "kv.db"), *FLAGS]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(scratch)})
    try:
        for _ in range(4):  # four turns in, the temporary archive made
            proc.stdout.readline()
        assert proc.poll() is None and list(scratch.glob("kvchat-recall-*"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    finally:
        proc.kill()
    assert not list(scratch.glob("kvchat-recall-*")) and not (tmp_path / "kv.db").exists()
