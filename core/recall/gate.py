"""Whether recalled text stays: it must make the user's message itself more predictable.

Recall chooses what to bring back by attention and shared words (core/recall/score.py, lexical.py, choose.py), and
that choice always finds something: the best-scoring evicted sentence, however little the message is about it. So
after the message has been read again with the recalled text before it, the two reads are compared: the mean
negative log-likelihood of the message's own content tokens (its last ``TAIL``, template scaffolding left out)
without and with the recalled text. A question in the fact's words is far more predictable once the fact is back in
view ("What is my locker code?" after "My locker code is 4417.": 0.8-2.7 nats per content token), one in other words
only a little ("Which combination opens my locker at the gym?": 0.1-0.4); a message that merely attended to some old
sentence gains about nothing, or loses. Below ``GAIN`` nats per token the recalled text is taken back and the turn
goes on from the first read, as if nothing had been recalled.

Measured on the default model (budget 256, the recall bench's 12 paraphrased questions, 1,024+ tokens of chat after
the fact, every recall kept to read its gain; docs/recall.md): ``streaming`` brought the fact back in 10 and the
question gained 0.11-1.14 in 9 of them, its two other recalls -0.21 and -0.15; ``h2o`` brought it back in 11, gaining
0.19-1.11 in 9, its other recall 0.12. The previous gate's 0.3 gave up 3 and 2 of those facts; 0.1 only those
whose question it made less predictable. On a 40-turn MT-Bench replay, where nothing needed had been evicted, the
NLL at 0.1 is within 0.1% of recall off's (budgets 256 and 512).
"""

from __future__ import annotations

import torch

TAIL = 32  # the message's last tokens whose likelihood the gate compares
GAIN = 0.1  # nats per content token the recalled text must save the message for it to stay


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
