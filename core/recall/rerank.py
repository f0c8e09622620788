"""Re-ranking recall's best candidates by what the model itself makes of them: how much more likely each makes the
user's message (query likelihood).

Attention over digests and shared words (score.py, lexical.py) find a fact asked for in its own words, but a
question in other words ("How do guests get online at our place?" for "Our wifi password is tulip2024.") shares no
word with it and draws little of a 135M model's attention among thousands of sentences. Read the other way round the
link is plain to the model: after the wifi sentence the question is far likelier than after any other. So the
``recall_rerank`` best candidates are each read, as a user message of their own, before the message's last
``QUESTION_TOKENS`` content tokens (a batch of short sequences through the model, no cache), and ranked by the
message's log-likelihood gain per token over reading it with no sentence before it (``gains``); a candidate that
does not make the message likelier at all is not brought back. This is the zero-shot re-ranking of Sachan et al.,
"Improving Passage Retrieval with Zero-Shot Question Generation" (EMNLP 2022), with the chat as the passages.

It costs a forward over about ``recall_rerank`` x 30 tokens per user message (through the decode step's layers where
one serves the model: ``_hidden``): on a GPU one batch the size of a short prefill (an H100's turn 260 of the GPU
bench's chat spent 44.8 ms in recall's scoring, this forward included; docs/gpu.md). On a CPU that multiplies bf16
natively an fp32 model reads them in bf16 (``BF16_READS``: only the ranking is wanted, and the products run about
twice as fast), with the rows and their width padded to a few sizes (``_padded``): oneDNN keeps its kernels for
every shape it multiplies in bf16, about 2 MB a shape for the default model. On this project's 2-core CPU 16
candidates cost 0.74-0.87 s a message in bf16, 1.13-1.16 s in fp32 (docs/recall.md), so it is on by default on a GPU
only.
"""

from __future__ import annotations

import contextlib

import torch

from .score import bucket, native_bf16

QUESTION_TOKENS = 24  # the message's last content tokens whose likelihood is compared
CANDIDATE_TOKENS = 32  # a candidate's first content tokens read before the message
BATCH = 32  # sequences per forward: the default pool and the message alone (17) in one
ROWS = 64  # positions whose logits (over the whole vocabulary, in fp32) are taken at once
GPU_DEFAULT = 16  # candidates re-ranked per message where ``recall_rerank`` is not set, on a GPU (0 elsewhere)
BF16_READS = native_bf16()  # an fp32 model on the CPU reads the candidates in bf16 (its logits stay fp32)
WIDTH_STEP = 16  # in bf16, rows are padded to a multiple of this many positions


def pool_size(setting: int | None, device: torch.device) -> int:
    """Candidates to re-rank: the setting where given, else ``GPU_DEFAULT`` on a GPU and none on a CPU."""
    if setting is not None:
        return setting
    return GPU_DEFAULT if torch.device(device).type == "cuda" else 0


@torch.inference_mode()
def gains(cm, question: torch.Tensor, candidates: list[torch.Tensor], pool: int | None = None) -> torch.Tensor:
    """[len(candidates)] the mean log-likelihood gain, in nats per token, of ``question`` (content token ids) read
    after each candidate (content token ids) as a user message of its own, over reading it after none. ``pool``:
    the candidates a full pool holds (in bf16 a batch of fewer is padded to a power of two rows)."""
    if not candidates or question.numel() == 0:
        return torch.zeros(len(candidates))
    head, tail = cm.chat.user_wrap()
    q = question.tolist()[-QUESTION_TOKENS:]
    prefixes = [head] + [head + c.tolist()[:CANDIDATE_TOKENS] + tail + head for c in candidates]
    out_head = cm.model.get_output_embeddings()
    device = cm.device
    bf16 = bf16_reads(cm)
    full = (pool if pool is not None else len(candidates)) + 1
    totals = []
    for i in range(0, len(prefixes), BATCH):
        chunk = prefixes[i:i + BATCH]
        rows = [p + q for p in chunk]
        n, width = len(rows), max(len(r) for r in rows)
        if bf16:
            n, width = _padded(n, min(BATCH, full - i), width)
        # right-padded: every row's tokens are at positions 0.., and causal attention never reads the padding (nor
        # a padding row, a copy of the first, anything of the others)
        ids = torch.full((n, width), q[0], dtype=torch.long)
        for r, row in enumerate(rows + rows[:1] * (n - len(rows))):
            ids[r, :len(row)] = torch.tensor(row)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            hidden = _hidden(cm, ids.to(device))[: len(rows)].to(out_head.weight.dtype)
        at = torch.stack([torch.arange(len(p) - 1, len(p) - 1 + len(q)) for p in chunk]).to(device)
        picked = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1])).flatten(0, 1)
        target = torch.tensor(q, device=device).repeat(len(chunk))
        totals.append(_logprobs(out_head, picked, target).view(len(chunk), -1).sum(-1).cpu())
    total = torch.cat(totals)
    return (total[1:] - total[0]) / len(q)


def bf16_reads(cm) -> bool:
    """Whether ``gains`` reads in bf16: an fp32 model on a CPU that multiplies bf16 natively (``BF16_READS``)."""
    return BF16_READS and cm.device.type == "cpu" and cm.model.dtype == torch.float32


def _padded(rows: int, full: int, width: int) -> tuple[int, int]:
    """(rows, width) a bf16 batch is read in: ``full`` rows (a full pool's batch) or else the next power of two,
    and the width a ``bucket`` of ``WIDTH_STEP`` (score.py's sizes for its own bf16 products): some 6 x 4 shapes in
    all, each kept by oneDNN for good (``BF16_READS``). Padding rows cost little where they come: a pool not yet
    full, early in a chat; a full pool's rows are not padded to a power of two (17 would be read as 32)."""
    if rows != full:
        rows = min(1 << (rows - 1).bit_length(), BATCH)
    return rows, bucket(width, WIDTH_STEP)


def _hidden(cm, ids: torch.Tensor) -> torch.Tensor:
    """The last hidden states [rows, width, hidden] of right-padded rows read with no cache: through the decode
    step's layers where one serves the model (core/decode/eager.py ``hidden``, the model's forward bit for bit),
    else the model's forward."""
    if cm.reader is not None:
        return cm.reader.hidden(ids, torch.arange(ids.shape[1], device=ids.device)[None])
    return cm.model.base_model(input_ids=ids, use_cache=False).last_hidden_state


def _logprobs(out_head, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[positions] log P(target) at each row of ``hidden`` ([positions, hidden size]), through the output layer
    ``ROWS`` positions at a time: the fp32 logits of 17 x 24 positions over a 128K vocabulary would be 200 MB at
    once."""
    out = []
    for a in range(0, hidden.shape[0], ROWS):
        logits = out_head(hidden[a: a + ROWS]).float()
        out.append(logits.gather(-1, target[a: a + ROWS, None])[:, 0] - logits.logsumexp(-1))
    return torch.cat(out)
