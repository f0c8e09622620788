"""Recall: evicted text comes back when a new user message needs it.

Every sentence group ever fed has a *digest* on disk beside the archive (``Digests``): for a few scoring layers
spread through the model's depth and for every KV head, the ``REPS`` keys of the group with the largest norm among
its tokens that are not template scaffolding, un-rotated to position 0 so that relevance does not depend on where
the group sat. When a user message has been fed, its queries in those layers (``QueryTap``, un-rotated the same way,
scaffolding rows left out) score every group with the model's own
attention (``relevance``): per layer, each query's softmax over the groups' representative keys; a group's score is
the largest share any query (and query head) gives it, averaged over the scoring layers. The best groups the cache
has (mostly) evicted are chosen (``choose``) and ``compress.compress(..., bring=...)`` puts them back into every
layer and head, displacing the running policy's lowest-scored tokens: kept and recalled keys alike are the archived
keys rotated once to their place in conversation order, so the cache stays a pure function of the archive and its
slot state (and resumes exactly). They are protected while the message is read again and through the reply's first
compression (``bring_back``); then the running policy keeps them as long as it scores them high enough.

Digests are written when a turn closes, synced and truncated with the archive; a conversation with recall off keeps
them too, so recall switched on later reaches the whole chat.
"""
