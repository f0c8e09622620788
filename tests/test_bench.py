"""``kvchat bench``: bad input is refused before any model loads; every quick bench writes its JSON, plots and
report section with its sanity checks held (on the real default model)."""

import json
import shutil

import pytest

from kvchat.app.cli import main
from kvchat.bench import cli as bench_cli

from helpers import REPO, data_file


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return exc.code


@pytest.mark.parametrize("argv, needle", [
    (["bench", "nosuch"], "invalid choice"),
    (["bench", "ppl", "--budgets", "0"], "--budgets must be positive"),
    (["bench", "ppl", "--budgets", "x"], "invalid int value"),
    (["bench", "recall", "--policies", "bogus"], "unknown policy 'bogus'"),
    (["bench", "recall", "--policies", "full"], "full is not a bounded policy"),
    (["bench", "speed", "--lengths", "-5"], "--lengths must be positive"),
    (["bench", "ppl", "--sinks", "-1"], "--sinks must be >= 0"),
])
def test_bad_input_exits_2_before_loading(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr("kvchat.bench.common.load_model", lambda spec, **kw: pytest.fail("the model must not load"))
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "kvchat: error: " in err or ": error: argument" in err or "kvchat bench: error: " in err


@pytest.mark.parametrize("lines, needle", [
    (['{"fact": "x {v}", "question": "q"}'], ":1: missing paraphrase, answer, values"),
    (['', 'not json'], ":2: not JSON"),
    (['{"fact": "x", "question": "q", "paraphrase": "p", "answer": "a {v}", "values": ["1", "2"]}'],
     ":1: the fact and the answer must each hold {v}"),
    (['{"fact": "x {v}", "question": "q", "paraphrase": "p", "answer": "a {v}", "values": ["1", "1"]}'],
     ":1: values must list two or more different"),
    (['{"fact": "x {v} {w}", "question": "q", "paraphrase": "p", "answer": "a {v}", "values": ["1", "2"]}'],
     ":1: braces other than {v} must be doubled"),
    ([], ": no facts in it"),
])
def test_a_bad_facts_file_is_refused_before_loading_naming_its_line(tmp_path, lines, needle, capsys, monkeypatch):
    monkeypatch.setattr("kvchat.bench.common.load_model", lambda spec, **kw: pytest.fail("the model must not load"))
    facts = tmp_path / "facts.jsonl"
    facts.write_text("\n".join(lines) + "\n")
    assert _exit_code(["bench", "recall", "--facts", str(facts)]) == 2
    err = capsys.readouterr().err
    assert f"argument --facts: {facts}{needle}" in err
    assert _exit_code(["bench", "recall", "--facts", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: neither bench nor heldout nor a file" in capsys.readouterr().err


def test_a_facts_file_plants_its_own_facts_and_distractors(tmp_path):
    """``--facts FILE``: each case plants one of the file's facts with a value from its list, asks its question (or
    its paraphrase), and a distractor case plants the others of its family beside it."""
    from kvchat.bench import recall

    data = REPO / "bench" / "facts" / "example.jsonl"
    facts = recall.load_facts(str(data))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(facts) == len(rows) >= 8
    fake = tmp_path / "data"
    (fake / "fastchat").mkdir(parents=True)
    (fake / "fastchat" / "dummy_conversation.json").write_text(json.dumps([{"conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]} for i in range(300)]))
    (fake / "fastchat" / "mt_bench_question.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["mt"]}))
    (fake / "fastchat" / "mt_bench_reference_answer_gpt-4.jsonl").write_text(
        json.dumps({"question_id": 1, "choices": [{"turns": ["mt answer"]}]}))
    cases = recall.make_cases(fake, ["direct", "paraphrase", "distractor"], len(rows), 0, facts)
    by_fact = {r["fact"]: r for r in rows}
    for case in cases:
        said = [t for t, _ in case["planted"]]
        row = next(r for r in rows if r["question"] == case["ask"] or r["paraphrase"] == case["ask"])
        mine = row["fact"].format(v=case["expect"])
        assert mine in said and case["expect"] in row["values"] and case["reference"] == row["answer"].format(
            v=case["expect"])
        assert case["ask"] == (row["paraphrase"] if case["kind"] == "paraphrase" else row["question"])
        others = [t for t in said if t != mine]
        family = [r for r in rows if r.get("family") == row.get("family") and r is not row]
        assert len(others) == (min(2, len(family)) if case["kind"] == "distractor" else 0)
        assert all(any(t == r["fact"].format(v=v) for r in family for v in r["values"]) for t in others)
    assert {c["ask"] for c in cases if c["kind"] == "paraphrase"} == {r["paraphrase"] for r in by_fact.values()}


def test_report_without_results_is_an_error(tmp_path, capsys):
    assert main(["bench", "report", "--out", str(tmp_path)]) == 2
    assert "no results under" in capsys.readouterr().err


def test_quick_sizes_apply_only_where_left_at_default():
    import argparse

    from kvchat.bench import ppl

    args = argparse.Namespace(quick=True, out="x", json=False, model="default", weights="auto", decode="auto",
                              tokens=777,
                              **{k: v for k, v in bench_cli._defaults(ppl).items() if k != "tokens"})
    ns = bench_cli._resolve(ppl, args)
    assert ns.tokens == 777  # set by the user
    assert ns.grid_tokens == ppl.QUICK["grid_tokens"] and ns.budgets == ppl.QUICK["budgets"]


def test_out_defaults_keep_quick_runs_out_of_docs(tmp_path, monkeypatch):
    import argparse

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    ns = argparse.Namespace
    assert bench_cli.output_dir(ns(quick=True, out=None)) == tmp_path / "bench-quick"
    assert str(bench_cli.output_dir(ns(quick=False, out=None))) == "docs"
    assert str(bench_cli.output_dir(ns(quick=True, out="docs"))) == "docs"  # asked for explicitly
    assert bench_cli.command_line("all", ns(quick=True, out=None, model="default")) == "kvchat bench all --quick"
    assert bench_cli.command_line("all", ns(quick=True, out="docs", model="default")).endswith("--quick --out docs")
    assert bench_cli.command_line("all", ns(quick=False, out="docs", model="default")) == "kvchat bench all"


def _snapshot(folder):
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.model
def test_quick_run_without_out_leaves_the_committed_results_alone(default_dir, tmp_path, capsys, monkeypatch):
    """A quick run writes to $KVCHAT_HOME/bench-quick, not over docs/ (a copy of the committed docs/ in the
    working directory, which is where the default ``docs`` resolves, so a regression cannot touch the real one)."""
    work, home = tmp_path / "work", tmp_path / "home"
    shutil.copytree(REPO / "docs", work / "docs")
    before = _snapshot(work / "docs")
    assert any(p.parts[0] == "results" for p in before) and "RESULTS.md" in {str(p) for p in before}
    monkeypatch.chdir(work)
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    monkeypatch.setenv("KVCHAT_DATA", str(data_file()))
    code = main(["bench", "durability", "--quick", "--model", str(default_dir)])  # the cheapest bench (seconds)
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    after = _snapshot(work / "docs")
    assert [str(p) for p in sorted(set(before) | set(after)) if before.get(p) != after.get(p)] == []  # none changed
    scratch = home / "bench-quick"
    assert f"quick run: writing to {scratch}" in err
    assert json.loads((scratch / "results" / "durability.json").read_text())["quick"]
    assert (scratch / "RESULTS.md").is_file()


def test_slope_and_segment_ppl():
    from kvchat.bench.memory import slope_per_1000
    from kvchat.bench.ppl import SEGMENT, ppl_between

    assert slope_per_1000([0, 1, 2, 3], [5, 5, 5, 5]) == 0
    assert slope_per_1000([0, 1000, 2000], [1.0, 2.0, 3.0]) == pytest.approx(1.0)
    row = {"segments": [0.0] * 4 + [1.0] * 4}
    assert ppl_between(row, 4 * SEGMENT) == pytest.approx(2.718281828)
    assert ppl_between(row, 0, 4 * SEGMENT) == pytest.approx(1.0)


@pytest.mark.model
@pytest.mark.slow
def test_quick_benches_write_json_plots_and_report(default_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVCHAT_DATA", str(data_file()))
    code = main(["bench", "all", "--quick", "--json", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    printed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["bench"] for r in printed] == list(bench_cli.ORDER)
    for name in bench_cli.ORDER:
        res = json.loads((tmp_path / "results" / f"{name}.json").read_text())
        assert res["quick"] and res["machine"]["cpu_count"] and res["wall_s"] > 0 and res["model"]
        assert res["command"].startswith("kvchat bench all --quick")
        assert res["sanity"] and all(c["ok"] for c in res["sanity"]), res["sanity"]
    plots = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert {"ppl_long.png", "ppl_budgets.png", "ppl_ablations.png", "recall.png", "speed.png", "memory.png",
            "headaware_classes.png"} <= plots
    md = (tmp_path / "RESULTS.md").read_text()
    for mod in map(bench_cli._module, bench_cli.ORDER):
        assert f"## {mod.TITLE}" in md
    assert "sink 0 worse than sink 4" in md and "kvpress side not run" in md
    ppl = json.loads((tmp_path / "results" / "ppl.json").read_text())["results"]["runs"]
    assert all(r["max_cache"] <= r["bound"] for r in ppl if r["bound"])


@pytest.mark.parametrize("budget", [64, 256])
def test_memory_benchs_reference_chat_is_as_full_as_the_long_one_at_any_budget(tiny, budget):
    """The reference chat timed beside the long one is fed until its policy first evicts (a fixed 40 exchanges held
    1,332 tokens of the default model: no cache of budget 4096 was full)."""
    from kvchat.bench.memory import reference_chat
    from kvchat.core.engine.session import Session
    from kvchat.core.engine.settings import Settings

    pairs = [(f"Question {i} about the harbour and its boats?", f"Answer {i}: the boats sail at dawn.")
             for i in range(7)]
    settings = Settings(policy="streaming", budget=budget)
    reference, turns = reference_chat(tiny("llama"), settings, pairs)
    assert reference.evicted_total > 0 and budget <= reference.cache_tokens <= settings.capacity
    assert turns == len([m for m in reference.messages if m["role"] == "user"])
    shorter = Session(tiny("llama"), settings)  # one exchange fewer: not yet full
    for t in range(turns - 1):
        shorter.exchange(*pairs[t % len(pairs)])
    assert shorter.evicted_total == 0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")
def test_speed_on_cuda_without_a_gpu_is_refused_before_any_model_loads(capsys, monkeypatch):
    monkeypatch.setattr("kvchat.bench.common.load_model", lambda spec, **kw: pytest.fail("the model must not load"))
    assert _exit_code(["bench", "speed", "--device", "cuda", "--out", "/nonexistent/x"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_a_gpu_turn_profile_says_which_stages_and_kernels_took_the_device():
    """A profiled turn on a GPU reports its longest kernels and each stage's device time beside its host time (the
    H100's turn 260 had 298.7 ms of kernels in a 271.7 ms turn, and the report said only where the host's went)."""
    from kvchat.bench import speed_cuda_kernels as kernels

    prof = {"wall_ms": 271.7, "kernels": 8573, "kernel_us": 298659.0, "waits": 585, "host_ops": 33857,
            "host_us": 111569.9, "top_host": [{"name": "aten::mm", "count": 684, "us": 13843.4}],
            "top_kernels": [{"name": "sm90_xmma_gemm_bf16bf16_bf16f32", "count": 400, "us": 120000.0}],
            "stages": {"kvchat.recall.plan": {"count": 1, "ms": 44.8, "device_ms": 40.1},
                       "kvchat.token": {"count": 8, "ms": 8.8, "device_ms": 9.0}}}
    line = kernels.profile_line("llama-1b", "turn 260", prof, "a chat turn")
    assert "The longest kernels: sm90_xmma_gemm_bf16bf16_bf16f32 120.0 ms ×400." in line
    assert "recall.plan 44.8 ms (40.1 on the device), token 8.8 ms (9.0 on the device) ×8." in line
    del prof["top_kernels"], prof["stages"]["kvchat.token"]["device_ms"]  # a profile on the CPU: host times only
    assert "kernels:" not in kernels.profile_line("tiny", "turn 7", prof, "a chat turn")


def test_gpu_report_says_what_a_watched_turns_peak_is_over():
    """The report of the measured GPU chat (docs/results/speed-cuda.json) says a peak is over the window's turns,
    and how many where a run began inside the window."""
    from kvchat.bench import speed_cuda

    res = json.loads((REPO / "docs" / "results" / "speed-cuda.json").read_text(encoding="utf-8"))
    chat = res["results"]["shapes"]["llama-1b"]["chat"]
    for key in ("peak_window", "peak_turns", "held_mb"):
        chat.pop(key, None)
    chat["runs"] = [{"from_turn": 0, "base_mb": 2000.0}, {"from_turn": 1594, "base_mb": 2100.0}]
    chat["peak_mb"] = {"100": 2265.0, "1750": 2425.0, "2000": 2428.0}
    assert "Peak GPU memory of a chat turn above" in speed_cuda.markdown(res)  # measured before there was a window
    chat["peak_window"], chat["peak_turns"] = 20, {"100": 20, "1750": 12, "2000": 20}
    md = speed_cuda.markdown(res)
    assert "Peak GPU memory over the 20 turns up to each watched one above" in md
    assert "turn 100: 265 MiB, turn 1750: 325 MiB (over 12 turns), turn 2000: 328 MiB" in md


def test_gpu_bench_chat_stopped_and_continued_is_the_chat_run_at_once(default_dir, tmp_path, monkeypatch):
    """The GPU bench's long chat is stored (``--chat-store``): a run stopped at turn 5 and continued by the next to
    turn 9 holds the very conversation of a run to turn 9 at once (greedy replies, token for token), keeps the first
    run's TTFT and records where each run started; its disk and time are watched at the last turn. A folder holding
    another model's chat, or another budget's, is refused in one line."""
    import argparse

    from kvchat.bench import speed, speed_cuda, speed_cuda_chat as chat
    from kvchat.bench.common import Run
    from kvchat.storage.db import Store

    cm = speed_cuda.build("tiny", str(default_dir), "cpu", "graph")
    monkeypatch.setattr(chat, "PROFILE_TURN", 7)  # past the budget: recall at work
    monkeypatch.setattr(chat, "LATE", 1)  # and turn 8 of a chat to turn 9 (not of one stopped at 5)

    def run(folder, last):
        out = {"ttft": [], "peak_mb": {}}
        chat.chat_cell(cm, 64, [3], [10], last, "cpu", out, store=str(folder))
        return out

    first, once = run(tmp_path / "a", 5), run(tmp_path / "b", 9)
    second = run(tmp_path / "a", 9)
    assert [r["from_turn"] for r in second["runs"]] == [1, 5] and second["turns"] == once["turns"] == 9
    assert second["ttft"] == first["ttft"] and [t["turn"] for t in once["ttft"]] == [3]
    assert set(second["disk_mb"]) == {5, 9} and second["disk_mb"][9] > 0 and second["turn_s"][9] > 0
    # a watched turn's peak is over the ordinary turns up to it in its run, opened again after a TTFT's message
    assert once["peak_turns"] == {9: 6} and second["peak_turns"] == {5: 2, 9: 4}
    assert [t for t in range(1, 2001) if chat.in_window(t, 2000) and not chat.in_window(t - 1, 2000)] == \
        [81] + list(range(250 - chat.PEAK_WINDOW + 1, 2000, chat.WATCH))
    # turn 7 ran under the profiler (on the CPU: its host operators), the same turn as the others' turn 7
    prof = second["turn_profile"]
    assert prof["turn"] == 7 and prof["host_ops"] > 100 and prof["kernels"] == 0 and len(prof["top_host"]) == 8
    assert "top_kernels" not in prof and not any("device_ms" in v for v in prof["stages"].values())
    assert prof["recall_ms"] > 0 and prof["ttft_ms"] > 0 and once["turn_profile"]["turn"] == 7
    assert "late_profile" not in first and second["late_profile"]["turn"] == once["late_profile"]["turn"] == 8
    # and where its time went: the turn's stages, each timed (the reply's tokens one by one)
    stages = prof["stages"]
    assert {"kvchat.message", "kvchat.recall.plan", "kvchat.prefill", "kvchat.token", "kvchat.closing",
            "kvchat.commit"} <= set(stages) and all(v["ms"] > 0 for v in stages.values())
    assert stages["kvchat.token"]["count"] == chat.CHAT_REPLY
    assert sum(v["ms"] for v in stages.values()) < prof["wall_ms"]  # none inside another

    def tokens(folder):
        store = Store(folder / "chat.db")
        (conv,) = store.conversations()
        return [(m["role"], m["tokens"]) for m in store.messages(conv["id"])]

    assert tokens(tmp_path / "a") == tokens(tmp_path / "b") and len(tokens(tmp_path / "a")) == 17
    # the bench itself, only the chat (--no-grid), continuing it: the report says where
    p = argparse.ArgumentParser()
    speed.add_arguments(p)
    ns = p.parse_args(["--device", "cpu", "--shapes", "tiny", "--budgets", "64", "--ttft-turns", "3", "--ttft-prompts",
                       "10", "--replay-turns", "12", "--no-grid", "--chat-store", str(tmp_path / "a"), "--tokenizer",
                       str(default_dir)])
    ns.model, ns.decode = "default", "graph"
    run = Run("speed-cuda", False, {})
    speed_cuda.run(ns, run)
    entry = run.rows["shapes"]["tiny"]
    assert entry["rows"] == [] and entry["chat"]["turns"] == 12 and len(entry["chat"]["runs"]) == 3
    report = speed_cuda.markdown(run.result())
    assert "(continued by another run at turn 5, 9)." in report and "tiny turn 7: a chat turn " in report
    assert "tiny turn 8: a chat turn " in report  # the late profile, kept from the run that took it
    with pytest.raises(ValueError, match=r"holds a chat of tiny at budget 64, not tiny at 128"):
        chat.stored_chat(tmp_path / "a", "tiny", 128)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        chat.stored_chat(tmp_path / "f", "tiny", 64)


def test_gpu_speed_bench_runs_its_whole_grid_on_a_tiny_model(default_dir, tmp_path):
    """bench/speed_cuda.py's every measurement on the CPU with the tiny shape (what a GPU run does at its sizes):
    rows for each policy and transformers, rooflines, compressions, the chat's TTFT, the report section. Variants are
    one code path (``GraphStep``'s flags); ``triton``'s is left out here (with it the test took 82 s, without 17:
    Triton's interpreter on the CPU), its steps' replies and caches are tests/test_graph_triton.py's."""
    import argparse

    from kvchat.bench import speed, speed_cuda
    from kvchat.bench.common import Run

    p = argparse.ArgumentParser()
    speed.add_arguments(p)
    ns = p.parse_args(["--device", "cpu", "--shapes", "tiny", "--budgets", "64", "--steps", "80", "--policies",
                       "streaming", "h2o", "--ttft-turns", "3", "--ttft-prompts", "10", "40", "--replay-turns", "6",
                       "--no-compiled-reference", "--graph-variants", "graph", "compiled", "graph-sync",
                       "--tokenizer",
                       str(default_dir)])
    ns.model, ns.decode = "default", "graph"
    run = Run("speed-cuda", False, {})
    speed_cuda.run(ns, run)
    rows = run.rows["shapes"]["tiny"]["rows"]
    assert [(r["policy"], r.get("step")) for r in rows] == [
        ("streaming", "graph"), ("h2o", "graph"), ("full", "graph"), ("transformers", None),
        ("streaming", "compiled"), ("h2o", "compiled"), ("full", "compiled"),
        ("streaming", "graph-sync"), ("h2o", "graph-sync"), ("full", "graph-sync")]
    for r in rows[:3] + rows[4:]:
        assert r["ms_per_token"] > 0 and r["roofline_ratio"] > 0 and r["eager_steps"] <= 1 and r["replays"] >= 79
        assert r["compile_error"] is None
    assert all(r["compress_ms"] for r in rows[:2])  # 80 steps past budget 64 + slack 64 - 64: compressions timed
    assert rows[3]["ms_per_token"] > 0 and "error" not in rows[3]
    ttft = run.rows["shapes"]["tiny"]["chat"]["ttft"]
    assert [t["turn"] for t in ttft] == [3, 4] and all(t["ttft_ms"] > 0 for t in ttft)
    # what of a TTFT is compressions: the 40-token message at turn 4 makes room in a full cache
    assert ttft[1]["compressions"] >= 1 and 0 < ttft[1]["compress_ms"] < ttft[1]["ttft_ms"]
    assert "error" not in run.rows["shapes"]["tiny"]["chat"]
    reads = run.rows["shapes"]["tiny"]["reads"]  # each message read through the step's layers and the model's forward
    assert list(reads) == [10, 40] and all(w[way]["ttft_ms"] > 0 for w in reads.values() for way in ("step", "model"))
    assert all(c["ok"] for c in run.checks)
    report = speed_cuda.markdown(run.result())
    assert "through the step's layers against the model's forward: 19 tokens " in report
    assert "| 64 | streaming |" in report and "| 64 | streaming · compiled |" in report
    assert "On disk (database, rows, state, digests), and a turn's mean time before it: turn 6: " in report
    assert "| 64 | streaming · graph-sync |" in report
    profiled = [r for r in rows if r.get("kernels")]  # streaming at the first budget, once per variant
    assert [(r["policy"], r["step"]) for r in profiled] == [("streaming", v)
                                                            for v in ("graph", "compiled", "graph-sync")]
    for r in profiled:  # on the CPU: the uncaptured step's operators, the two layers' products among them
        k = r["kernels"]
        assert k["source"] == "uncaptured" and k["kernels_per_layer"] > 5 and k["kernel_us"] > 0
        assert any("linear" in t["name"] or "mm" in t["name"] for t in k["top"])
    assert "tiny streaming (uncaptured):" in report
    squeezed = [r for r in rows if r.get("compress_profile")]  # each policy at the first budget, the first variant
    assert [(r["policy"], r["step"]) for r in squeezed] == [("streaming", "graph"), ("h2o", "graph")]
    # on the CPU no kernels: the host's operators; and no value read back (the evicted groups are counted on the
    # device and read when the turn closes)
    for r in squeezed:
        p = r["compress_profile"]
        assert p["wall_ms"] > 0 and p["kernels"] == 0 and p["host_ops"] > 10 and p["host_us"] > 0
        assert p["waits"] == 0 and len(p["top_host"]) == 8
        assert all(k["name"].startswith("aten::") for k in p["top_host"])
    assert "tiny streaming: a compression" in report and "tiny h2o: a compression" in report
