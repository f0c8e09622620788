"""Whether recalled text stays: it must make the user's message itself markedly more predictable.

Recall chooses what to bring back by attention over digests (core/recall/score.py, choose.py), and that choice
always finds something: the best-scoring evicted sentence, however little the message is about it. So after the
message has been read again with the recalled text before it, the two reads are compared: the mean negative
log-likelihood of the message's own content tokens (its last ``TAIL``, template scaffolding left out) without and
with the recalled text. A question about an evicted fact is far more predictable once the fact is back in view
("What is my locker code?" after "My locker code is 4417."); a message that merely attended to some old sentence is
not. Below ``GAIN`` nats per token the recalled text is taken back and the turn goes on from the first read, as if
nothing had been recalled.

Measured on the default model (``streaming`` at budget 256, 1,024+ tokens of chat after a planted fact; docs/
recall.md): of 36 questions (18 on the recall bench's facts, 18 on held-out ones never used to tune recall), 29
brought the fact back, and the message then gained 0.83-2.73 nats per content token in 26 of them, 0.12-0.38 in three
paraphrased ones; the other 7 recalls gained -0.93 to 0.30; the 36 recalls of a 40-turn MT-Bench replay, where
nothing needed had been evicted, -0.20 to 0.39 (one 1.05). At 0.3 the gate keeps 28 of the 29 facts, 1 of the 7 and
3 of the 36 others, and the replay's NLL is the recall-off run's or lower.
"""

from __future__ import annotations

import torch

TAIL = 32  # the message's last tokens whose likelihood the gate compares
GAIN = 0.3  # nats per content token the recalled text must save the message for it to stay


def content_nll(tail: tuple[torch.Tensor, torch.Tensor], scaffolding: torch.Tensor) -> float | None:
    """Mean negative log-likelihood of the content tokens among ``tail`` ((token ids, log-probabilities), as
    ``_feed(tail=...)`` leaves them); None when the tail holds no content token."""
    ids, logprobs = tail
    content = ~torch.isin(ids, scaffolding)
    if not bool(content.any()):
        return None
    return float(-logprobs[content].float().mean())


def keeps(without: float | None, with_recall: float | None) -> bool:
    """Whether the recalled text stays: the message's content NLL without it less with it is at least ``GAIN``."""
    if without is None or with_recall is None:
        return False
    return without - with_recall >= GAIN
