"""Stopping a reply while its long message is still read: the session goes back to before the message, exactly, and
nothing of it is stored; a short message's read is not stopped part way (the reply stops after its first token)."""

import pytest
import torch

from kvchat.core.engine.feeding import STOPPABLE
from kvchat.core.engine.session import ReadStopped, Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.storage.db import Store
from test_durability import assert_same_cache

GREEDY = Sampling(max_new_tokens=8, temperature=0.0)
BEFORE = ["Hello there. Tell me about the sea!", "And the mountains? Are they tall?"]
LONG = " ".join(f"Fact {i}: the red box holds {i * 7} stones. It sits by door {i % 9}." for i in range(40))


def _cancel_in_forward(session, n: int) -> None:
    """The session cancelled from inside its ``n``-th model forward from now, as the Stop button does from another
    thread while the model reads."""
    real, count = session.forward, [0]

    def forward(*args, **kwargs):
        count[0] += 1
        if count[0] == n:
            session.cancel()
        return real(*args, **kwargs)

    session.forward = forward


def _pair(model, settings, tmp_path, undo):
    made = []
    for name in ("stopped", "never"):
        s = Session(model, settings, store=Store(tmp_path / f"{name}.db"), sampling=GREEDY, undo=undo)
        for text in BEFORE:
            s.chat(text)
        made.append(s)
    return made


@pytest.mark.parametrize("policy, recall", [("streaming", "off"), ("h2o", "off"), ("snapkv", "on"), ("tova", "on"),
                                            ("headaware", "off")])
@pytest.mark.parametrize("undo", [True, False])
def test_a_stopped_read_leaves_the_session_as_before_the_message(tiny, tmp_path, policy, recall, undo):
    model = tiny("llama")
    settings = Settings(policy=policy, budget=96, window=8, slack=16, groups="sentence", recall=recall)
    stopped, never = _pair(model, settings, tmp_path, undo)
    assert len(model.tokenizer(LONG)["input_ids"]) > STOPPABLE
    history = list(stopped.history)
    _cancel_in_forward(stopped, 3)  # read in chunks of the slack with compressions between: stopped part way
    gen = stopped.reply(LONG)
    with pytest.raises(ReadStopped) as info:
        next(gen)
    del stopped.forward
    assert 0 < info.value.read < info.value.total
    assert stopped.messages == never.messages and stopped.history == history
    assert_same_cache(stopped, never)
    # Nothing of it was stored: the stored conversation reopens as the session is.
    assert_same_cache(Session.resume(model, stopped.store, stopped.conversation_id), never)
    if undo:  # the turn before the stopped message can still be taken back
        assert stopped.undo() == never.undo()
        assert_same_cache(stopped, never)
    # And the chat goes on as if the message had never been sent (recall, compressions and sampling included).
    assert stopped.chat("Which do you like best?").answer == never.chat("Which do you like best?").answer
    assert_same_cache(stopped, never)


def test_a_read_is_stopped_between_chunks_only_for_a_long_message(tiny):
    model = tiny("llama")
    settings = Settings(policy="h2o", budget=96, window=8, slack=16)
    session = Session(model, settings, sampling=Sampling(max_new_tokens=30, temperature=0.0))
    short = " ".join(["word"] * 60)  # read in several chunks too, but each a few milliseconds: not stopped part way
    _cancel_in_forward(session, 2)
    res = session.chat(short)
    assert res.stopped == "cancelled" and res.new_tokens == 1
    # A Stop pressed when no reply streams does not stop the next one (the engine starts un-cancelled).
    del session.forward
    session.cancel()
    assert session.chat(LONG).stopped != "cancelled"


@pytest.mark.parametrize("recall", ["off", "on"])
def test_reading_says_how_far_the_long_message_is_read(tiny, recall):
    """What a UI shows while a long message is read (``Session.reading``): the message's tokens read so far, rising
    (where recall reads its last ``budget`` tokens again, from there), of one total (not the reply's header read after
    it, apart, when recall runs between); None once it is read."""
    model = tiny("llama")
    session = Session(model, Settings(policy="h2o", budget=96, window=8, slack=16, recall=recall), sampling=GREEDY)
    for text in BEFORE * 4:
        session.chat(text)
    seen, real = [], session.forward

    def forward(*args, **kwargs):
        seen.append(session.reading)
        return real(*args, **kwargs)

    session.forward = forward
    session.chat(LONG)
    del session.forward
    shown = [r for r in seen if r is not None]
    assert len(shown) > 10 and len({total for _, total in shown}) == 1 and shown[0][1] > STOPPABLE
    read, total = [r for r, _ in shown], shown[0][1]
    back = [j for j in range(1, len(read)) if read[j] < read[j - 1]]
    assert session.reading is None and (back == [] if recall == "off" else len(back) <= 1)
    # With recall a message may be read again where its last ``budget`` tokens start, once (core/engine/feeding.py).
    assert all(read[j] >= total - 96 and read[j:] == sorted(read[j:]) for j in back)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])])
def test_a_stopped_read_leaves_the_graph_step_valid(tokenizer, device):
    """Under the graph step (captured on a GPU), a stopped read puts the cache back into the same buffers: the step is
    not captured again, and the chat goes on as the one never sent the message."""
    from test_graph import _pair

    _, graph = _pair("llama", tokenizer, device=device, dtype=torch.float32)
    settings = Settings(policy="h2o", budget=96, window=8, slack=16)
    sessions, answers = [], []
    for stop in (True, False):
        session = Session(graph, settings, sampling=GREEDY)
        for text in BEFORE * 3:
            session.chat(text)
        captures = graph.step.captures
        if stop:
            _cancel_in_forward(session, 3)
            with pytest.raises(ReadStopped):
                session.chat(LONG)
            del session.forward
        answers.append(session.chat("Which do you like best?").answer)
        assert graph.step.captures == captures and session.evicted_total > 0
        sessions.append(session)
    assert answers[0] == answers[1] and graph.step.replays > 0, (graph.step.captures, graph.step.replays)
    assert_same_cache(*sessions)


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_a_read_stopped_while_recall_reads_the_message_again(tiny, tmp_path, monkeypatch, policy):
    """Stopped after recall put text back and while it reads the message's last tokens again: the session is as
    before the message all the same (what recall brought back, its guard and staged keys included)."""
    from kvchat.core.recall import choose

    model = tiny("llama")
    settings = Settings(policy=policy, budget=96, window=8, slack=16, recall="on")
    sessions = []
    for name in ("stopped", "never"):
        s = Session(model, settings, store=Store(tmp_path / f"{name}.db"), sampling=GREEDY)
        for text in BEFORE * 4:
            s.chat(text)
        sessions.append(s)
    stopped, never = sessions
    assert stopped.digests.count > 0
    real, brought = choose.bring_back, []

    def bring_back(session, *args, **kwargs):  # Stop pressed as recall puts its text back
        brought.append(session.cancel())
        return real(session, *args, **kwargs)

    monkeypatch.setattr(choose, "bring_back", bring_back)
    with pytest.raises(ReadStopped):
        stopped.chat(LONG)
    monkeypatch.undo()
    assert brought and stopped.messages == never.messages
    assert_same_cache(stopped, never)
    assert stopped.chat("Which do you like best?").answer == never.chat("Which do you like best?").answer
    assert_same_cache(stopped, never)
    assert_same_cache(Session.resume(model, stopped.store, stopped.conversation_id), never)


def test_a_settings_change_as_the_message_is_sent_stays_when_its_read_is_stopped(tiny, tmp_path):
    """A live change between the message's send and its read (the settings panel, from another thread) is stored at
    once; a stop of the read puts the session back as before the message, with the change: the undo copy it goes
    back to predates the change, which is applied again (as ``undo`` does)."""
    model = tiny("llama")
    settings = Settings(policy="h2o", budget=96, window=8, slack=16, recall="off")
    stopped, never = _pair(model, settings, tmp_path, undo=True)
    gen = stopped.reply(LONG)
    stopped.configure(budget=48)
    never.configure(budget=48)
    _cancel_in_forward(stopped, 3)
    with pytest.raises(ReadStopped):
        next(gen)
    del stopped.forward
    assert stopped.settings == never.settings and stopped.settings.budget == 48
    assert_same_cache(stopped, never)
    assert_same_cache(Session.resume(model, stopped.store, stopped.conversation_id), never)
    assert stopped.chat("Which do you like best?").answer == never.chat("Which do you like best?").answer
