"""The token log: per-position columns read back exactly as appended (through truncations), at a few bytes per
token rather than one int32 per column."""

import random

import pytest
import torch

from kvchat.core.engine.tokens import TokenLog


def _rows(rng: random.Random, message: int, turn: int, sentence: int, m: int) -> tuple[dict, int]:
    rows = {"token": [rng.randrange(50_000) for _ in range(m)], "role": [message % 3] * m, "turn": [turn] * m,
            "message": [message] * m, "sentence": []}
    for _ in range(m):
        if rng.random() < 0.1:
            sentence += 1
        rows["sentence"].append(sentence)
    return rows, sentence


def test_columns_read_back_through_appends_and_truncations():
    rng = random.Random(0)
    log, dense = TokenLog(), {name: [] for name in TokenLog.COLUMNS}
    sentence, message = 0, 0
    for step in range(300):
        if step % 37 == 36:  # undo: cut somewhere in the last few hundred positions
            n = max(0, log.n - rng.randrange(1, 300))
            log.truncate(n, (0, True))
            for col in dense.values():
                del col[n:]
            continue
        if rng.random() < 0.4:  # a new message (else the last one goes on, as a reply decoded token by token)
            message += 1
        rows, sentence = _rows(rng, message, message // 2, sentence, rng.choice([1, 1, 2, 7, 40]))
        start = log.n
        assert log.append(rows).tolist() == list(range(start, start + len(rows["token"])))
        for name in TokenLog.COLUMNS:
            dense[name] += rows[name]
    assert log.n == len(dense["token"]) > 1000
    positions = torch.randint(0, log.n, (3, 50))
    for name in TokenLog.COLUMNS:
        want = torch.tensor(dense[name], dtype=torch.int32)
        assert torch.equal(log.column(name), want)
        assert torch.equal(log.column(name, 123), want[123:])
        assert torch.equal(log.at(name, positions), want[positions])
        if name != "token":
            ids, lengths = log.runs(name)
            assert torch.equal(torch.repeat_interleave(ids, lengths), want)


def test_a_long_log_costs_a_few_bytes_per_token():
    rng = random.Random(1)
    log, sentence = TokenLog(), 0
    for message in range(4000):  # 30-token messages of 10-token sentences
        rows, sentence = _rows(rng, message, message // 2, sentence, 30)
        log.append(rows)
    assert log.n == 120_000
    # one int32 per column would be 20 bytes a token (more with the storage grown by doubling)
    assert log.nbytes < 10 * log.n, log.nbytes / log.n


@pytest.mark.parametrize("name", ["role", "sentence"])
def test_empty_and_start_past_the_end(name):
    log = TokenLog()
    assert log.column(name).numel() == 0 and log.column("token", 5).numel() == 0
    rows, _ = _rows(random.Random(2), 0, 0, 0, 5)
    log.append(rows)
    assert log.column(name, 9).numel() == 0


def test_streamed_text_is_the_whole_decode(tokenizer):
    """The detokenizer decodes a short window per token, and what it streams adds up to decoding the reply at once,
    characters split over tokens (accents, CJK, emoji) and random token sequences included."""
    import random

    from kvchat.core.engine.tokens import Detokenizer

    rng = random.Random(0)
    text = "Hello wörld — ça va? 日本語のテキスト 🙂🙂 and\nnew lines   spaced, 12345."
    sequences = [tokenizer(text, add_special_tokens=False)["input_ids"]]
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))] for _ in range(100)]
    for ids in sequences:
        detok = Detokenizer(tokenizer)
        streamed = "".join(detok.push(i) for i in ids)
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
