"""The decode loop's run-ahead (core/engine/generate.py): on a GPU the sampled token is fed to the captured step on the
device before the host reads it, so the next step runs while the host streams this one. It must change nothing a
user sees or keeps: the same replies, the same token log, the same cache, whatever ends the reply. On the CPU the
graph step runs uncaptured with ``runs_ahead`` set, against the same step feeding each token once it is read."""

from unittest import mock

import pytest
import torch

from kvchat.core.engine.generate import Generation
from kvchat.core.engine.session import Sampling, Session
from kvchat.core.engine.settings import Settings
from kvchat.core.model.loading import ChatModel
from kvchat.policies import POLICIES

from tinymodels import build_tiny

MESSAGES = ["Hello there. Tell me about the sea!", "And the mountains? Are they tall? Some are.",
            "What about rivers in the north, and lakes?"]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _pair(tokenizer, device="cpu", dtype=torch.float32):
    """The same tiny Llama twice on the graph step: feeding each token once it is read, and running ahead."""
    out = []
    for ahead in (False, True):
        model = build_tiny("llama", tokenizer).to(device=device, dtype=dtype)
        cm = ChatModel.from_pretrained_model(model, tokenizer, name="tiny-llama", decode="graph")
        cm.step.runs_ahead = ahead
        out.append(cm)
    return out


def _settings(policy):
    return Settings(policy="full") if not POLICIES[policy].bounded else \
        Settings(policy=policy, budget=48, window=8, slack=8)


class _Count:
    """How many tokens ``_feed_ahead`` fed (it returns None where it waits for the host)."""

    def __init__(self):
        self.fed, self.declined, plain = 0, 0, Generation._feed_ahead

        def counting(session, picked):
            out = plain(session, picked)
            self.fed, self.declined = self.fed + (out is not None), self.declined + (out is None)
            return out

        self.patch = mock.patch.object(Generation, "_feed_ahead", counting)


def _assert_same_state(a: Session, b: Session, atol: float = 1e-5) -> None:
    assert a.log.n == b.log.n
    for name in a.log.COLUMNS:
        assert torch.equal(a.log.column(name), b.log.column(name)), name
    assert a.messages == b.messages
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert la.lens == lb.lens
        assert torch.equal(la.positions(), lb.positions())
        torch.testing.assert_close(lb.keys_dense(), la.keys_dense(), atol=atol, rtol=0)
        torch.testing.assert_close(lb.padded(lb.values), la.padded(la.values), atol=atol, rtol=0)
        for name in la.stats:
            torch.testing.assert_close(lb.padded(lb.stats[name]), la.padded(la.stats[name]), atol=atol, rtol=0)
        assert torch.equal(la.padded(la.rows), lb.padded(lb.rows))


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "tova", "full"])
def test_running_ahead_gives_the_same_chat(policy, tokenizer):
    """Three greedy replies through compressions: the same answers, token log (ids, roles, messages, sentences),
    cache and statistics; tokens are fed ahead between compressions and after one are fed once read."""
    sequential, ahead = _pair(tokenizer)
    sampling = Sampling(max_new_tokens=24, temperature=0.0)
    sessions = [Session(cm, _settings(policy), sampling=sampling) for cm in (sequential, ahead)]
    count = _Count()
    for text in MESSAGES:
        first = sessions[0].chat(text)
        with count.patch:
            second = sessions[1].chat(text)
        assert (first.answer, first.stopped, first.new_tokens) == (second.answer, second.stopped, second.new_tokens)
    _assert_same_state(*sessions)
    assert count.fed >= 60
    if POLICIES[policy].bounded:
        assert sessions[1].evicted_total > 0 and count.declined > 0  # no room: a compression once the token is read
    assert ahead.step.replays == sequential.step.replays


def test_sampling_draws_the_same_tokens(tokenizer):
    """A draw with penalties, top-p and a seed: the generator is asked as often, the processors see the same ids."""
    sampling = Sampling(max_new_tokens=30, temperature=0.9, top_p=0.9, repetition_penalty=1.3)
    answers = []
    for cm in _pair(tokenizer):
        session = Session(cm, _settings("h2o"), sampling=sampling, seed=7)
        answers.append([session.chat(text).answer for text in MESSAGES])
    assert answers[0] == answers[1]


@pytest.mark.parametrize("end", ["eos", "max_tokens", "cancelled", "closed"])
def test_whatever_ends_the_reply_the_turn_is_the_same(end, tokenizer):
    """The last token fed ahead is not fed again when the reply closes: a stop token, the token limit, a cancel from
    another thread and the consumer closing the stream give the turn and the next reply of the step fed once read."""
    pair = _pair(tokenizer)
    probe = Session(pair[0], _settings("streaming"), sampling=Sampling(max_new_tokens=12, temperature=0.0))
    probe.chat(MESSAGES[0])
    stop = int(probe.log.column("token")[-4])  # a token the reply produces (before its last and the closing)
    results = []
    for cm in pair:
        session = Session(cm, _settings("streaming"), sampling=Sampling(max_new_tokens=12, temperature=0.0))
        with mock.patch.object(cm, "stop_ids", frozenset({stop}) if end == "eos" else cm.stop_ids):
            gen = session.reply(MESSAGES[0], max_new_tokens=5 if end == "max_tokens" else 12)
            for i, _ in enumerate(gen):
                if i == 2 and end == "cancelled":
                    session.cancel()
                if i == 2 and end == "closed":
                    gen.close()
                    break
        results.append((session.history[-1].stopped, session.history[-1].answer,
                        session.chat(MESSAGES[1]).answer))
        if cm is pair[1]:
            _assert_same_state(first, session)
        first = session
    assert results[0] == results[1]
    assert results[0][0] == {"closed": "cancelled"}.get(end, end)


def test_the_models_last_positions_stop_the_reply_as_before(tokenizer):
    """The full cache on a model of 512 positions: the reply stops for room (``context_full``) with the closing
    tokens' reserve kept, running ahead or not."""
    out = []
    for cm in _pair(tokenizer):
        session = Session(cm, Settings(policy="full"), system=None, sampling=Sampling(max_new_tokens=64,
                                                                                      temperature=0.0))
        session.feed_raw(torch.randint(10, 1000, (470,), generator=torch.Generator().manual_seed(0)).tolist(),
                         score=False)
        res = session.chat("Go on.")
        out.append((res.stopped, res.answer, session.log.n))
    assert out[0] == out[1] and out[0][0] == "context_full" and out[0][2] <= 512


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("greedy", [True, False])
def test_captured_step_running_ahead_gives_the_same_chat(greedy, tokenizer):
    """On a GPU, where it runs by default: the captured step takes each token from the sampler on the device (a draw
    too: its uniform number comes from the session's generator on the host) and gives the replies and cache of the
    same captured step fed each token once the host has read it."""
    sampling = Sampling(max_new_tokens=24, temperature=0.0) if greedy else \
        Sampling(max_new_tokens=24, temperature=0.8, top_p=0.95, repetition_penalty=1.2)
    sequential, ahead = _pair(tokenizer, device="cuda", dtype=torch.bfloat16)
    assert ahead.step.capture and ahead.step.runs_ahead
    sessions = [Session(cm, _settings("h2o"), sampling=sampling, seed=3) for cm in (sequential, ahead)]
    count = _Count()
    for text in MESSAGES:
        first = sessions[0].chat(text)
        with count.patch:
            second = sessions[1].chat(text)
        assert (first.answer, first.stopped) == (second.answer, second.stopped)
    _assert_same_state(*sessions, atol=3e-2)
    assert count.fed >= 60 and ahead.step.captures == sequential.step.captures >= 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.cuda])])
def test_sessions_chatting_at_once_on_one_step_get_what_each_gets_alone(device, tokenizer):
    """The web UI's sessions share the loaded model and its step, each with its own cache (on a GPU its own graph),
    and chat in threads of their own: two chatting at once, through compressions and recall, running ahead, give
    the replies and caches each gives alone (fp32). On a GPU one thread's capture or replay runs while the other
    reads its message through the model's forward."""
    import threading

    _, cm = _pair(tokenizer, device=device)
    sampling = Sampling(max_new_tokens=24, temperature=0.0)
    chats = [(Settings(policy="h2o", budget=48, window=8, slack=8), MESSAGES),
             (Settings(policy="streaming", budget=56, window=8, slack=8), MESSAGES[::-1])]

    def chat(settings, messages, out, start=None):
        session = Session(cm, settings, sampling=sampling)
        if start is not None:
            start.wait()
        out.append([session.chat(m).answer for m in messages])
        out.append(session)

    alone = [[] for _ in chats]
    for (settings, messages), out in zip(chats, alone):
        chat(settings, messages, out)
    together, errors, start = [[] for _ in chats], [], threading.Barrier(len(chats))

    def run(*args):
        try:
            chat(*args, start=start)
        except BaseException as exc:  # noqa: BLE001 — raised again in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(*c, out), daemon=True) for c, out in zip(chats, together)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a session's chat did not end in 5 minutes"
    for (replies, session), (want, reference) in zip(together, alone):
        assert replies == want
        assert session.evicted_total > 0
        _assert_same_state(reference, session)
    assert cm.step.eager_calls == 0 and cm.step.replays >= 4 * 24
