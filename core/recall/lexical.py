"""Word overlap: a second opinion beside attention on which archived sentences a user message is about.

Attention over digests (core/recall/score.py) links meaning, but a small model also spreads its attention over a
chat's pleasantries and misses plain shared words ("Which numbers open the lock on my bicycle?" against "My bike lock
code is 5104." ranked 18th of 95 by attention). So every archived group is also scored by BM25 over the words it
shares with the message (``bm25``; words are the tokenizer's tokens in one normal form: lower case, without the
leading space, ``normal_forms``; a word's rarity is counted over the groups archived), and the two rankings are
merged by reciprocal rank (``fuse``): a group high in either list comes up, one high in both comes first.
"""

from __future__ import annotations

import torch

K1, B = 1.2, 0.75  # BM25's usual term saturation and length normalisation
FUSE_K = 60  # reciprocal rank fusion's usual constant: a group's share is 1 / (FUSE_K + its rank), per list


def normal_forms(tokenizer) -> torch.Tensor:
    """[vocabulary] for each token id the id of its normal form (the first id with the same lower-case text,
    without a leading space or word-start marker); -1 for tokens with no letter or digit (punctuation, spaces,
    template markers), which say nothing about what a message is about."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    out, first = torch.full((len(pieces),), -1, dtype=torch.long), {}
    for i, piece in enumerate(pieces):
        # without GPT-2's word-start Ġ or SentencePiece's ▁
        word = (piece or "").replace("\u0120", "").replace("\u2581", "").strip().lower()
        if any(c.isalnum() for c in word) and not (word.startswith("<") and word.endswith(">")):
            out[i] = first.setdefault(word, i)
    return out


def word_forms(model) -> torch.Tensor:
    """``normal_forms`` of a ChatModel's tokenizer less its chat template's own tokens ("user" is no topic), over
    every id the model can produce (-1 past the tokenizer's own: models often pad their vocabulary, and a sampled
    padding id has no word), computed once and kept on the model (``model.words``)."""
    if getattr(model, "words", None) is None:
        forms = normal_forms(model.tokenizer)
        vocab = getattr(model.model.config, "vocab_size", None) or 0
        forms = torch.cat([forms, forms.new_full((max(vocab - len(forms), 0),), -1)])
        forms[model.scaffolding_ids().long()] = -1
        model.words = forms
    return model.words


def bm25(message: torch.Tensor, tokens: torch.Tensor, spans: torch.Tensor, forms: torch.Tensor) -> torch.Tensor:
    """[groups] the BM25 score of each group (``spans``: [groups, 2] positions into ``tokens``, the conversation's
    token ids, in order) for the words of ``message`` (token ids); 0 where they share none."""
    groups = spans.shape[0]
    out = torch.zeros(groups)
    words = forms[message.long()]
    words = words[words >= 0].unique()
    if groups == 0 or words.numel() == 0:
        return out
    lo, hi = int(spans[0, 0]), int(spans[-1, 1])
    wanted = torch.isin(forms, words)  # [vocabulary] the token ids whose word the message has: one lookup a token
    hit = wanted[tokens[lo:hi]].nonzero().flatten()
    if hit.numel() == 0:
        return out
    pos = hit + lo
    group = torch.searchsorted(spans[:, 1].contiguous(), pos, right=True)
    inside = group < groups
    group, pos, hit = group[inside], pos[inside], hit[inside]
    inside = pos >= spans[group, 0]
    group, hit = group[inside], hit[inside]
    # counted sparsely, per (group, word) pair that occurs: the cost follows the matches, not groups x words
    term = torch.searchsorted(words, forms[tokens[hit + lo].long()])
    pair, tf = torch.unique(group * words.numel() + term, return_counts=True)
    g, w = pair // words.numel(), pair % words.numel()
    df = torch.bincount(w, minlength=words.numel()).float()
    idf = torch.log1p((groups - df + 0.5) / (df + 0.5))
    sizes = (spans[:, 1] - spans[:, 0]).float()
    norm = K1 * (1 - B + B * sizes[g] / sizes.mean().clamp(min=1))
    tf = tf.float()
    return out.index_add_(0, g, idf[w] * tf * (K1 + 1) / (tf + norm))


def fuse(*scores: torch.Tensor) -> torch.Tensor:
    """[groups] reciprocal rank fusion of the score lists: the sum over lists of 1 / (``FUSE_K`` + the group's rank
    in it, from 1), a list counting only for the groups it scores above 0."""
    out = torch.zeros(scores[0].shape[0])
    for s in scores:
        scored = (s > 0).nonzero().flatten()  # ranked among themselves: the others come after them all
        order = scored[s[scored].argsort(descending=True, stable=True)]
        out[order] += 1.0 / (FUSE_K + torch.arange(1, order.numel() + 1, dtype=torch.float32))
    return out
