"""The Triton kernels of ``graph_triton`` (imported only where Triton is): plain functions that ``graph_triton``
compiles for a GPU (``triton.jit``) or runs in Triton's interpreter on a CPU. Pointers into [rows, D] buffers; the
sums in fp32. Attention's products take fp32 tiles: TF32 (``PREC``) holds a bf16 or fp16 value exactly, so on a GPU
they are the products of the 16-bit values on tensor cores, and the probabilities keep 10 bits where a bf16 product
would keep 7 (Triton's interpreter multiplies 16-bit floats' bits as integers: fp32 tiles are right there too). A
flag (``K0``, ``STAT``, ``RING``, ``ACC``, ``ADD``) says whether an optional buffer is there (the launch passes
another tensor in its place where it is not)."""

import triton
import triton.language as tl

KERNELS = ("add_norm", "silu_mul", "rotate_write", "attend_part", "attend_done")


def add_norm(x, y, weight, total, normed, eps, N: tl.constexpr, NP: tl.constexpr, ADD: tl.constexpr):
    i = tl.arange(0, NP)
    inside = i < N
    xv = tl.load(x + i, mask=inside, other=0.0)
    if ADD:
        xv = (xv.to(tl.float32) + tl.load(y + i, mask=inside, other=0.0).to(tl.float32)).to(total.dtype.element_ty)
        tl.store(total + i, xv, mask=inside)
    xf = xv.to(tl.float32)
    scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    out = xf * scale * tl.load(weight + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(normed + i, out.to(normed.dtype.element_ty), mask=inside)


def silu_mul(gate_up, out, inner, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    inside = i < inner
    g = tl.load(gate_up + i, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(gate_up + inner + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + i, (g * tl.sigmoid(g) * u).to(out.dtype.element_ty), mask=inside)


def rotate_write(qkv, cos, sin, lens, offs, inputs, keys, values, k0, abs_pos, computed, rows, stat, ring_q,
                 ring_pos, q, NQ: tl.constexpr, NK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, K0: tl.constexpr, STAT: tl.constexpr, RING: tl.constexpr):
    h = tl.program_id(0)
    j = tl.arange(0, DP)
    jin = j < D
    turned = (j + D // 2) % D  # x * cos + roll(x, D / 2) * sin' (sin' carries rotate_half's signs)
    c = tl.load(cos + j, mask=jin, other=0.0).to(tl.float32)
    s = tl.load(sin + j, mask=jin, other=0.0).to(tl.float32)
    # the key and the value at the head's new row, with the row's positions, storage row and statistic
    r = tl.load(offs + h) + tl.load(lens + h) + tl.load(inputs + 4)  # inputs: token, pos, abs pos, row, steps
    kx = qkv + NQ + h * D
    k = (tl.load(kx + j, mask=jin, other=0.0).to(tl.float32) * c
         + tl.load(kx + turned, mask=jin, other=0.0).to(tl.float32) * s).to(keys.dtype.element_ty)
    tl.store(keys + r * D + j, k, mask=jin)
    if K0:
        tl.store(k0 + r * D + j, k, mask=jin)
    v = tl.load(qkv + NQ + NK + h * D + j, mask=jin, other=0.0)
    tl.store(values + r * D + j, v.to(values.dtype.element_ty), mask=jin)
    tl.store(abs_pos + r, tl.load(inputs + 2).to(tl.int32))
    tl.store(computed + r, tl.load(inputs + 1).to(tl.int32))
    tl.store(rows + r, -1)
    if STAT:
        tl.store(stat + r, 0.0)
    # the head's queries, rotated, in the model's dtype
    g = tl.arange(0, GP)
    heads = (h * G + g)[:, None]
    inside = (g < G)[:, None] & jin[None, :]
    qx = (tl.load(qkv + heads * D + j[None, :], mask=inside, other=0.0).to(tl.float32) * c[None, :]
          + tl.load(qkv + heads * D + turned[None, :], mask=inside, other=0.0).to(tl.float32) * s[None, :])
    qx = qx.to(q.dtype.element_ty)
    tl.store(q + heads * D + j[None, :], qx, mask=inside)
    if RING:
        w = tl.load(inputs + 3)
        tl.store(ring_q + w * NQ + heads * D + j[None, :], qx.to(tl.float32), mask=inside)
        if h == 0:
            tl.store(ring_pos + w, tl.load(inputs + 1).to(tl.float32))


@triton.jit
def _split(q, offs, lens, inputs, h, sp, chunk, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
           DP: tl.constexpr):
    """Head ``h``'s queries (fp32, [GP, DP]), its first row, and split ``sp``'s slots [lo, hi): up to the new token's
    slot (the head's length at the upload plus the steps since)."""
    g = tl.arange(0, GP)
    j = tl.arange(0, DP)
    qv = tl.load(q + (h * G + g)[:, None] * D + j[None, :], mask=(g < G)[:, None] & (j < D)[None, :],
                 other=0.0).to(tl.float32)
    last = (tl.load(lens + h) + tl.load(inputs + 4)).to(tl.int32)  # the bounds in one type
    lo = sp * chunk
    return qv, tl.load(offs + h), lo, tl.minimum(lo + chunk, last + 1)


def attend_part(q, keys, values, offs, lens, inputs, part_m, part_l, part_o, chunk, scaling, G: tl.constexpr,
                GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr, SPLITS: tl.constexpr,
                PREC: tl.constexpr):
    """Split ``sp`` of head ``h``: slots [sp * chunk, min((sp + 1) * chunk, n + 1)) (n: the new token's, the head's
    length at the upload plus the steps since), an online softmax over them: the running maximum, sum and weighted
    values per query (part_m, part_l, part_o)."""
    h = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.arange(0, GP)
    j = tl.arange(0, DP)
    jin = j < D
    qv, first, lo, hi = _split(q, offs, lens, inputs, h, sp, chunk, G, GP, D, DP)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for start in range(lo, hi, B):
        slot = start + tl.arange(0, B)
        valid = slot < hi
        at = (first + slot)[:, None] * D + j[None, :]
        k = tl.load(keys + at, mask=valid[:, None] & jin[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(qv, tl.trans(k), input_precision=PREC) * scaling
        scores = tl.where(valid[None, :], scores, float("-inf"))
        top = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - top)
        p = tl.exp(scores - top[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(values + at, mask=valid[:, None] & jin[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m = top
    base = (h * SPLITS + sp) * GP + g
    tl.store(part_m + base, m)
    tl.store(part_l + base, total)
    tl.store(part_o + base[:, None] * DP + j[None, :], acc, mask=(g < G)[:, None])  # the queries' rows alone


def attend_done(q, keys, offs, lens, inputs, part_m, part_l, part_o, acc, out, chunk, scaling, G: tl.constexpr,
                GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr, SPLITS: tl.constexpr,
                PREC: tl.constexpr, ACC: tl.constexpr):
    """The splits of head ``h`` combined: split 0's program writes the output; with ``ACC`` each split's program
    adds its slots' probabilities, averaged over the head's queries, to ``acc``."""
    h = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.arange(0, GP)
    j = tl.arange(0, DP)
    jin = j < D
    every = tl.arange(0, SPLITS)  # a split's maximum is -inf where it held no slot: its weight 0
    if sp == 0:  # per query: its splits' outputs as one [SPLITS, DP] tile, weighted and summed
        for gi in range(G):
            at = (h * SPLITS + every) * GP + gi
            m_g = tl.load(part_m + at)
            weight = tl.exp(m_g - tl.max(m_g, axis=0))
            o = tl.sum(tl.load(part_o + at[:, None] * DP + j[None, :]) * weight[:, None], axis=0)
            o = o / tl.sum(tl.load(part_l + at) * weight, axis=0)
            tl.store(out + (h * G + gi) * D + j, o.to(out.dtype.element_ty), mask=jin)
    if ACC:  # each slot's probability: its score against every split's maximum and sum, per query
        ms = tl.load(part_m + (h * SPLITS + every)[:, None] * GP + g[None, :])  # [SPLITS, GP]
        top = tl.max(ms, axis=0)
        total = tl.sum(tl.load(part_l + (h * SPLITS + every)[:, None] * GP + g[None, :]) * tl.exp(ms - top[None, :]),
                       axis=0)
        qv, first, lo, hi = _split(q, offs, lens, inputs, h, sp, chunk, G, GP, D, DP)
        for start in range(lo, hi, B):
            slot = start + tl.arange(0, B)
            valid = slot < hi
            k = tl.load(keys + (first + slot)[:, None] * D + j[None, :], mask=valid[:, None] & jin[None, :],
                        other=0.0).to(tl.float32)
            scores = tl.dot(qv, tl.trans(k), input_precision=PREC) * scaling
            p = tl.exp(scores - top[:, None]) / total[:, None]
            p = tl.where((g < G)[:, None], p, 0.0)
            before = tl.load(acc + first + slot, mask=valid, other=0.0)
            tl.store(acc + first + slot, before + tl.sum(p, axis=0) / G, mask=valid)
