"""Recall: evicted text comes back when a new user message needs it.

While recall is on, every sentence group fed gets a *digest* (``Digests``, core/recall/digest.py; int8, on disk,
capped by ``--archive-mb``): for a few scoring layers spread through the model's depth and for every KV head, the
``REPS`` keys of the group with the largest norm among its tokens that are not template scaffolding, un-rotated to
position 0 so that relevance does not depend on where the group sat. When a user message has been fed, its queries
in those layers (``QueryTap``, un-rotated the same way, scaffolding rows left out) score every group with the model's
own attention (``relevance``, core/recall/score.py): per layer, each query's softmax over the groups' representative
keys; a group's score is the largest share any query (and query head) gives it, averaged over the scoring layers.
That ranking is merged with one by the words the message shares with each group (BM25, core/recall/lexical.py).
Where ``--recall-rerank`` asks (by default on a GPU), its best candidates are read again by the model, each before
the message, and ranked by how much likelier each makes it (core/recall/rerank.py). The best groups the
cache has (mostly) evicted, one copy of each text, are chosen and put back (core/recall/choose.py): the running
policy's lowest-scored tokens make room, the recalled text is read again from its token ids, every head goes back
into conversation order. The message is then read again after it, and the recalled text
stays only if it makes the message more predictable (core/recall/gate.py); else the turn goes on from the first
read.
"""
