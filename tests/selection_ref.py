"""Independent, slow, loop-by-loop NumPy reference for block selection and block-sparse attention.

Written from the algorithm alone (docs/algorithm.md, sections 2, 3, 6); it imports nothing from the project.
Everything is plain Python loops over float64 numbers so that each rule can be read off directly.

Shapes: B batch, T tokens, H query heads, K kv heads, G = H // K, D head dim.
Query head h belongs to kv group h // G.

Conventions (ambiguities resolved here, see also the docstrings):
  * Compressed chunk c covers tokens [c*stride, c*stride + kernel_size); it is VISIBLE to a query
    at position p iff its last token is <= p, i.e. c*stride + kernel_size - 1 <= p.
  * Block k covers tokens [k*block_size, (k+1)*block_size); a query at position p lies in block
    q_blk = p // block_size. Candidates are the blocks 0..q_blk (future blocks are never chosen).
  * Forced blocks (score +inf): k < init_blocks, and q_blk - local_blocks <= k <= q_blk (so the
    current block is always forced, even with local_blocks = 0); only candidates can be forced.
  * A block whose score is -inf is never chosen (forced blocks are +inf, so always eligible).
  * Top-k ties (equal scores, including several +inf forced blocks when there are more forced
    blocks than topk) are broken in favour of the LOWER block index.
  * Output rows: chosen block ids sorted ascending, padded with -1 to length topk, dtype int32.
"""

from __future__ import annotations

import math

import numpy as np

NEG_INF = -math.inf
POS_INF = math.inf


# ----------------------------------------------------------------------------------------------
# 1. Key compression
# ----------------------------------------------------------------------------------------------


def num_compressed(T: int, kernel_size: int, stride: int) -> int:
    """N_c = (T - kernel_size) // stride + 1 when T >= kernel_size, else 0 (full windows only)."""
    if T < kernel_size:
        return 0
    return (T - kernel_size) // stride + 1


def compress_keys_ref(k, kernel_size: int, stride: int):
    """k [B, T, K, D] -> kc [B, N_c, K, D], kc[c] = mean(k[c*stride : c*stride + kernel_size])."""
    k = np.asarray(k, dtype=np.float64)
    B, T, K, D = k.shape
    n_c = num_compressed(T, kernel_size, stride)
    kc = np.zeros((B, n_c, K, D), dtype=np.float64)
    for b in range(B):
        for c in range(n_c):
            for m in range(K):
                for d in range(D):
                    total = 0.0
                    for t in range(c * stride, c * stride + kernel_size):
                        total += float(k[b, t, m, d])
                    kc[b, c, m, d] = total / kernel_size
    return kc


def _compress_scalar_ref(x, kernel_size: int, stride: int):
    """x [B, T, K] -> [B, N_c, K], mean over the same full windows as compress_keys_ref."""
    x = np.asarray(x, dtype=np.float64)
    B, T, K = x.shape
    n_c = num_compressed(T, kernel_size, stride)
    out = np.zeros((B, n_c, K), dtype=np.float64)
    for b in range(B):
        for c in range(n_c):
            for m in range(K):
                total = 0.0
                for t in range(c * stride, c * stride + kernel_size):
                    total += float(x[b, t, m])
                out[b, c, m] = total / kernel_size
    return out


# ----------------------------------------------------------------------------------------------
# 2. Geometry: overlap and visibility
# ----------------------------------------------------------------------------------------------


def block_overlap_ref(c: int, block_k: int, kernel_size: int, stride: int, block_size: int) -> bool:
    """Does chunk c (tokens [c*stride, c*stride+kernel_size)) share a token with block block_k
    (tokens [block_k*block_size, (block_k+1)*block_size))? Two half-open intervals [a0, a1) and
    [b0, b1) overlap iff a0 < b1 and b0 < a1."""
    c_start = c * stride
    c_end = c * stride + kernel_size  # exclusive
    b_start = block_k * block_size
    b_end = (block_k + 1) * block_size  # exclusive
    return c_start < b_end and b_start < c_end


def chunk_visible_ref(c: int, p: int, kernel_size: int, stride: int) -> bool:
    """Chunk c is visible to a query at position p iff its last token c*stride+kernel_size-1 <= p."""
    return c * stride + kernel_size - 1 <= p


# ----------------------------------------------------------------------------------------------
# Shared selection helpers
# ----------------------------------------------------------------------------------------------


def _logsumexp(values):
    """log(sum(exp(v))) of a non-empty list of finite floats, computed stably."""
    mx = max(values)
    return mx + math.log(sum(math.exp(v - mx) for v in values))


def pool_chunks_to_blocks_ref(chunk_scores, p: int, n_blocks: int, *, block_size: int,
                              kernel_size: int, stride: int):
    """chunk_scores: list of N_c floats (for one query). Returns a list of n_blocks floats:
    block k scores the max over VISIBLE chunks c overlapping k; -inf if there is none."""
    out = []
    for blk in range(n_blocks):
        best = NEG_INF
        for c in range(len(chunk_scores)):
            if not chunk_visible_ref(c, p, kernel_size, stride):
                continue
            if not block_overlap_ref(c, blk, kernel_size, stride, block_size):
                continue
            if chunk_scores[c] > best:
                best = chunk_scores[c]
        out.append(best)
    return out


def forced_blocks_ref(p: int, *, block_size: int, init_blocks: int, local_blocks: int):
    """The set of forced blocks for a query at position p: candidates 0 <= k <= q_blk that are
    init (k < init_blocks) or local (q_blk - local_blocks <= k <= q_blk)."""
    q_blk = p // block_size
    forced = set()
    for blk in range(0, q_blk + 1):
        if blk < init_blocks:
            forced.add(blk)
        if q_blk - local_blocks <= blk <= q_blk:
            forced.add(blk)
    return forced


def topk_blocks_ref(scores_by_block: dict, topk: int):
    """scores_by_block: {block id: score} over the CANDIDATES only (forced ones already +inf).
    Keep those whose score is not -inf, take the `topk` highest, ties -> lower block index first.
    Returns a list of length topk: chosen ids ascending, then -1 padding."""
    eligible = [(blk, s) for blk, s in scores_by_block.items() if s != NEG_INF]
    # Sort by score descending, then by block index ascending (the tie-break).
    eligible.sort(key=lambda item: (-item[1], item[0]))
    chosen = sorted(blk for blk, _ in eligible[:topk])
    return chosen + [-1] * (topk - len(chosen))


def _select_from_block_scores(block_scores, p: int, *, block_size: int, init_blocks: int,
                              local_blocks: int, topk: int):
    """block_scores: list indexed by block (may be shorter than q_blk + 1: missing blocks score
    -inf). Applies causality, forcing and top-k; returns the padded row."""
    q_blk = p // block_size
    forced = forced_blocks_ref(p, block_size=block_size, init_blocks=init_blocks,
                               local_blocks=local_blocks)
    candidates = {}
    for blk in range(0, q_blk + 1):
        if blk in forced:
            candidates[blk] = POS_INF
        elif blk < len(block_scores):
            candidates[blk] = float(block_scores[blk])
        else:
            candidates[blk] = NEG_INF
    return topk_blocks_ref(candidates, topk)


# ----------------------------------------------------------------------------------------------
# 3. InfLLM-V2 selection
# ----------------------------------------------------------------------------------------------


def infllmv2_chunk_scores_ref(q, kc, q_positions, *, kernel_size: int, stride: int,
                              coarse_lse=None, k_raw=None):
    """Group scores S[b, m, i, c] = sum over heads h of group m of p_h(i, c), where
    p_h(i, c) = softmax over visible chunks of q_h . kc_c / sqrt(D) (0 for invisible chunks is NOT
    used: invisible chunks get -inf). If no chunk is visible the whole row is -inf.

    coarse_lse = (kernel2, stride2): p_h(c) = exp(q.kc_c/sqrt(D) - LSE_h), LSE_h = logsumexp over
    the coarse chunks c2 visible to p of q.kc2_c2/sqrt(D), kc2 = compress_keys_ref(k_raw, kernel2,
    stride2). If no coarse chunk is visible, LSE_h falls back to the exact LSE over fine chunks.
    Returns float64 [B, K, Tq, N_c]."""
    q = np.asarray(q, dtype=np.float64)
    kc = np.asarray(kc, dtype=np.float64)
    q_positions = np.asarray(q_positions)
    B, Tq, H, D = q.shape
    _, n_c, K, _ = kc.shape
    assert H % K == 0, "H must be a multiple of K"
    G = H // K
    scale = 1.0 / math.sqrt(D)

    kc2 = None
    if coarse_lse is not None:
        assert k_raw is not None, "coarse_lse needs k_raw"
        kernel2, stride2 = coarse_lse
        kc2 = compress_keys_ref(k_raw, kernel2, stride2)

    S = np.full((B, K, Tq, n_c), NEG_INF, dtype=np.float64)
    for b in range(B):
        for m in range(K):
            for i in range(Tq):
                p = int(q_positions[b, i])
                visible = [c for c in range(n_c) if chunk_visible_ref(c, p, kernel_size, stride)]
                if not visible:
                    continue  # row stays -inf
                total = {c: 0.0 for c in visible}
                for h in range(m * G, (m + 1) * G):
                    logits = {}
                    for c in visible:
                        dot = 0.0
                        for d in range(D):
                            dot += q[b, i, h, d] * kc[b, c, m, d]
                        logits[c] = dot * scale
                    lse = None
                    if kc2 is not None:
                        n_c2 = kc2.shape[1]
                        coarse_logits = []
                        for c2 in range(n_c2):
                            if chunk_visible_ref(c2, p, kernel2, stride2):
                                dot = 0.0
                                for d in range(D):
                                    dot += q[b, i, h, d] * kc2[b, c2, m, d]
                                coarse_logits.append(dot * scale)
                        if coarse_logits:
                            lse = _logsumexp(coarse_logits)
                    if lse is None:  # exact LSE (default, or coarse fallback)
                        lse = _logsumexp(list(logits.values()))
                    for c in visible:
                        total[c] += math.exp(logits[c] - lse)  # no division by G
                for c in visible:
                    S[b, m, i, c] = total[c]
    return S


def _select_from_chunk_scores(S, q_positions, *, block_size, init_blocks, local_blocks, topk,
                              kernel_size, stride):
    """S [B, K, Tq, N_c] (-inf for invisible) -> ids int32 [B, K, Tq, topk]."""
    B, K, Tq, _ = S.shape
    ids = np.full((B, K, Tq, topk), -1, dtype=np.int32)
    for b in range(B):
        for m in range(K):
            for i in range(Tq):
                p = int(q_positions[b, i])
                q_blk = p // block_size
                n_blocks = max(q_blk + 1, 0)
                block_scores = pool_chunks_to_blocks_ref(
                    [float(x) for x in S[b, m, i]], p, n_blocks, block_size=block_size,
                    kernel_size=kernel_size, stride=stride)
                row = _select_from_block_scores(block_scores, p, block_size=block_size,
                                                init_blocks=init_blocks,
                                                local_blocks=local_blocks, topk=topk)
                ids[b, m, i, :] = row
    return ids


def select_infllmv2_ref(q, kc, q_positions, *, block_size: int, init_blocks: int,
                        local_blocks: int, topk: int, kernel_size: int, stride: int,
                        coarse_lse=None, k_raw=None):
    """InfLLM-V2 block selection. q [B, Tq, H, D], kc [B, N_c, K, D], q_positions int [B, Tq].
    Returns int32 [B, K, Tq, topk]: chosen blocks ascending, -1 padded (ties -> lower index)."""
    q_positions = np.asarray(q_positions)
    S = infllmv2_chunk_scores_ref(q, kc, q_positions, kernel_size=kernel_size, stride=stride,
                                  coarse_lse=coarse_lse, k_raw=k_raw)
    return _select_from_chunk_scores(S, q_positions, block_size=block_size,
                                     init_blocks=init_blocks, local_blocks=local_blocks,
                                     topk=topk, kernel_size=kernel_size, stride=stride)


# ----------------------------------------------------------------------------------------------
# 4. Forecast selection (SparDA)
# ----------------------------------------------------------------------------------------------


def forecast_chunk_scores_ref(f, kc, q_positions, *, kernel_size: int, stride: int):
    """Raw logits S[b, m, i, c] = f[b, i, m] . kc[b, c, m] / sqrt(D) for visible chunks, -inf else.
    f [B, Tq, K, D] -> [B, K, Tq, N_c]."""
    f = np.asarray(f, dtype=np.float64)
    kc = np.asarray(kc, dtype=np.float64)
    q_positions = np.asarray(q_positions)
    B, Tq, K, D = f.shape
    n_c = kc.shape[1]
    assert kc.shape[2] == K
    scale = 1.0 / math.sqrt(D)
    S = np.full((B, K, Tq, n_c), NEG_INF, dtype=np.float64)
    for b in range(B):
        for m in range(K):
            for i in range(Tq):
                p = int(q_positions[b, i])
                for c in range(n_c):
                    if not chunk_visible_ref(c, p, kernel_size, stride):
                        continue
                    dot = 0.0
                    for d in range(D):
                        dot += f[b, i, m, d] * kc[b, c, m, d]
                    S[b, m, i, c] = dot * scale
    return S


def select_forecast_ref(f, kc, q_positions, *, block_size: int, init_blocks: int,
                        local_blocks: int, topk: int, kernel_size: int, stride: int):
    """Forecast block selection: one head per kv group, raw logits, same pooling/forcing/top-k."""
    q_positions = np.asarray(q_positions)
    S = forecast_chunk_scores_ref(f, kc, q_positions, kernel_size=kernel_size, stride=stride)
    return _select_from_chunk_scores(S, q_positions, block_size=block_size,
                                     init_blocks=init_blocks, local_blocks=local_blocks,
                                     topk=topk, kernel_size=kernel_size, stride=stride)


# ----------------------------------------------------------------------------------------------
# 5. NOSA selection
# ----------------------------------------------------------------------------------------------


def nosa_select_ref(qk_block_scores, cis_block_scores, q_positions, *, block_size: int,
                    init_blocks: int, local_blocks: int, qk_topk: int, topk: int):
    """Two-stage NOSA selection per (b, m, i):
      1. stage 1 = the qk_topk best candidate blocks by qk_block_scores (forced blocks +inf,
         causal, -inf never chosen, ties -> lower index);
      2. the stage-1 blocks get +inf in (a copy of) cis_block_scores;
      3. final = the topk best candidate blocks (k <= q_blk) by that cis score, -inf never chosen,
         ties -> lower index. Forcing is NOT re-applied in stage 3: only stage-1 blocks are +inf.
    Blocks k <= q_blk with k >= N_blocks (no score column) count as -inf (forced still +inf in
    stage 1). Inputs float [B, K, Tq, N_blocks]; output int32 [B, K, Tq, topk]."""
    qk = np.asarray(qk_block_scores, dtype=np.float64)
    cis = np.asarray(cis_block_scores, dtype=np.float64)
    q_positions = np.asarray(q_positions)
    B, K, Tq, n_blocks = qk.shape
    assert cis.shape == qk.shape
    ids = np.full((B, K, Tq, topk), -1, dtype=np.int32)
    for b in range(B):
        for m in range(K):
            for i in range(Tq):
                p = int(q_positions[b, i])
                q_blk = p // block_size
                stage1 = _select_from_block_scores(
                    [float(x) for x in qk[b, m, i]], p, block_size=block_size,
                    init_blocks=init_blocks, local_blocks=local_blocks, topk=qk_topk)
                stage1 = {blk for blk in stage1 if blk >= 0}
                candidates = {}
                for blk in range(0, q_blk + 1):
                    if blk in stage1:
                        candidates[blk] = POS_INF
                    elif blk < n_blocks:
                        candidates[blk] = float(cis[b, m, i, blk])
                    else:
                        candidates[blk] = NEG_INF
                ids[b, m, i, :] = topk_blocks_ref(candidates, topk)
    return ids


def cis_block_scores_ref(cis, n_blocks: int, *, block_size: int, kernel_size: int, stride: int,
                         q_positions):
    """cis [B, T, K] per-token scores -> [B, K, Tq, n_blocks]: mean-pool over full windows
    (kernel_size, stride) as for keys, then block k = max over compressed positions c that are
    visible to the query (c*stride + kernel_size - 1 <= p) and overlap block k; -inf if none."""
    q_positions = np.asarray(q_positions)
    cc = _compress_scalar_ref(cis, kernel_size, stride)  # [B, N_c, K]
    B, n_c, K = cc.shape
    Tq = q_positions.shape[1]
    out = np.full((B, K, Tq, n_blocks), NEG_INF, dtype=np.float64)
    for b in range(B):
        for m in range(K):
            for i in range(Tq):
                p = int(q_positions[b, i])
                row = pool_chunks_to_blocks_ref([float(cc[b, c, m]) for c in range(n_c)], p,
                                                n_blocks, block_size=block_size,
                                                kernel_size=kernel_size, stride=stride)
                out[b, m, i, :] = row
    return out


# ----------------------------------------------------------------------------------------------
# 6-7. Attention
# ----------------------------------------------------------------------------------------------


def _attend_ref(q, k, v, key_sets, bias):
    """key_sets[b][m][i]: sorted list of key indices attended by query i of kv group m.
    Returns float64 [B, Tq, H, D]; a query with no attended key gets 0."""
    B, Tq, H, D = q.shape
    K = k.shape[2]
    G = H // K
    scale = 1.0 / math.sqrt(D)
    out = np.zeros((B, Tq, H, D), dtype=np.float64)
    for b in range(B):
        for h in range(H):
            m = h // G
            for i in range(Tq):
                keys = key_sets[b][m][i]
                if not keys:
                    continue  # out stays 0
                logits = []
                for j in keys:
                    dot = 0.0
                    for d in range(D):
                        dot += q[b, i, h, d] * k[b, j, m, d]
                    logit = dot * scale
                    if bias is not None:
                        logit += float(bias[b, j, m])
                    logits.append(logit)
                mx = max(logits)
                weights = [math.exp(x - mx) for x in logits]
                z = sum(weights)
                for d in range(D):
                    acc = 0.0
                    for w, j in zip(weights, keys):
                        acc += w * v[b, j, m, d]
                    out[b, i, h, d] = acc / z
    return out


def sparse_attention_ref(q, k, v, block_ids, q_positions, bias=None, *, block_size: int):
    """Block-sparse attention. q [B, Tq, H, D], k, v [B, S, K, D] (keys at positions 0..S-1),
    block_ids int [B, K, Tq, n_sel] (-1 / negative = padding, duplicates count once),
    bias [B, S, K] or None (added to the logits). Query i of head h attends key j iff j lies in a
    selected block of kv head h // G, j <= q_positions[b, i] and j < S. Returns [B, Tq, H, D]."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    block_ids = np.asarray(block_ids)
    q_positions = np.asarray(q_positions)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
    B, Tq, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    assert H % K == 0
    key_sets = []
    for b in range(B):
        per_m = []
        for m in range(K):
            per_i = []
            for i in range(Tq):
                p = int(q_positions[b, i])
                keys = set()
                for blk in block_ids[b, m, i]:
                    blk = int(blk)
                    if blk < 0:
                        continue
                    for j in range(blk * block_size, (blk + 1) * block_size):
                        if j <= p and j < S:
                            keys.add(j)
                per_i.append(sorted(keys))
            per_m.append(per_i)
        key_sets.append(per_m)
    return _attend_ref(q, k, v, key_sets, bias)


def dense_attention_ref(q, k, v, q_positions, bias=None):
    """Causal dense attention: every key j <= q_positions[b, i] (and j < S) is attended."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    q_positions = np.asarray(q_positions)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
    B, Tq, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    key_sets = []
    for b in range(B):
        per_m = []
        for m in range(K):
            per_i = []
            for i in range(Tq):
                p = int(q_positions[b, i])
                per_i.append([j for j in range(S) if j <= p])
            per_m.append(per_i)
        key_sets.append(per_m)
    return _attend_ref(q, k, v, key_sets, bias)


# ==============================================================================================
# Self-checks against hand-derived expectations
# ==============================================================================================


def test_ref_block_overlap_minicpm_geometry():
    # Chunk c = tokens [16c, 16c+32), block k = tokens [64k, 64k+64).
    # Overlap iff 16c < 64k+64 (c < 4k+4, i.e. c <= 4k+3) and 64k < 16c+32 (c > 4k-2, i.e.
    # c >= 4k-1). So exactly c in [4k-1, 4k+3].
    for blk in range(0, 8):
        got = [c for c in range(-3, 40) if block_overlap_ref(c, blk, 32, 16, 64)]
        assert got == list(range(4 * blk - 1, 4 * blk + 4)), (blk, got)


def test_ref_block_overlap_small_geometry():
    # Chunk c = tokens [2c, 2c+4), block k = tokens [4k, 4k+4).
    # 2c < 4k+4 -> c <= 2k+1 ; 4k < 2c+4 -> c >= 2k-1. So c in {2k-1, 2k, 2k+1}.
    for blk in range(0, 6):
        got = [c for c in range(-3, 20) if block_overlap_ref(c, blk, 4, 2, 4)]
        assert got == [2 * blk - 1, 2 * blk, 2 * blk + 1]


def test_ref_compress_keys():
    # T = 6, kernel 4, stride 2 -> N_c = (6-4)//2 + 1 = 2.
    # k[t] = t: kc[0] = mean(0,1,2,3) = 1.5 ; kc[1] = mean(2,3,4,5) = 3.5.
    k = np.arange(6, dtype=np.float64).reshape(1, 6, 1, 1)
    kc = compress_keys_ref(k, 4, 2)
    assert kc.shape == (1, 2, 1, 1)
    np.testing.assert_allclose(kc[0, :, 0, 0], [1.5, 3.5])
    # T < kernel -> no chunk.
    assert compress_keys_ref(np.zeros((1, 3, 1, 1)), 4, 2).shape == (1, 0, 1, 1)
    # Exactly one window when T == kernel.
    assert compress_keys_ref(np.zeros((1, 4, 2, 3)), 4, 2).shape == (1, 1, 2, 3)


def _hand_keys():
    """T = 24, one kv head, D = 2. All keys zero except tokens 8..11 (= exactly block 2 for
    block_size 4) which are [1, 0]. With kernel 4 / stride 2 (chunk c = tokens 2c..2c+3):
      kc_3 = tokens 6..9   -> two of four are [1,0] -> [0.5, 0]
      kc_4 = tokens 8..11  -> [1, 0]
      kc_5 = tokens 10..13 -> [0.5, 0]
      all other kc = 0. N_c = (24-4)//2 + 1 = 11."""
    k = np.zeros((1, 24, 1, 2))
    k[0, 8:12, 0, 0] = 1.0
    return k


def test_ref_hand_infllmv2_content_block():
    k = _hand_keys()
    kc = compress_keys_ref(k, 4, 2)
    np.testing.assert_allclose(kc[0, :, 0, 0], [0, 0, 0, 0.5, 1, 0.5, 0, 0, 0, 0, 0])
    q = np.zeros((1, 1, 1, 2))
    q[0, 0, 0, 0] = 10.0
    pos = np.array([[23]])
    # p = 23: q_blk = 5. Visible: 2c+3 <= 23 -> c <= 10, all 11 chunks.
    # Logits: c4 = 10/sqrt2 = 7.07, c3 = c5 = 5/sqrt2 = 3.54, rest 0 -> p(c4) > p(c3) = p(c5) > rest.
    # Block k pools c in {2k-1, 2k, 2k+1}:
    #   block1 = max(c1,c2,c3) = p(c3); block2 = max(c3,c4,c5) = p(c4); block3 = max(c5,c6,c7) = p(c5).
    # Forced (init 1, local 1): {0} u {4, 5}.
    kw = dict(block_size=4, init_blocks=1, local_blocks=1, kernel_size=4, stride=2)
    # topk 4: 3 forced + the best content block = block 2.
    assert select_infllmv2_ref(q, kc, pos, topk=4, **kw)[0, 0, 0].tolist() == [0, 2, 4, 5]
    # topk 5: next best are blocks 1 and 3, tied at p(c3) = p(c5); lower index wins -> block 1.
    assert select_infllmv2_ref(q, kc, pos, topk=5, **kw)[0, 0, 0].tolist() == [0, 1, 2, 4, 5]
    # topk 6: every candidate 0..5 has a finite score.
    assert select_infllmv2_ref(q, kc, pos, topk=6, **kw)[0, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    # topk 8: only 6 candidates (future blocks are never chosen) -> two -1 pads.
    assert select_infllmv2_ref(q, kc, pos, topk=8, **kw)[0, 0, 0].tolist() == [0, 1, 2, 3, 4, 5,
                                                                               -1, -1]


def test_ref_hand_forecast():
    k = _hand_keys()
    kc = compress_keys_ref(k, 4, 2)
    pos = np.array([[23]])
    kw = dict(block_size=4, init_blocks=1, local_blocks=1, kernel_size=4, stride=2)
    # f = [10, 0]: same logits as the InfLLM-V2 hand case -> block 2 wins.
    f = np.zeros((1, 1, 1, 2))
    f[0, 0, 0, 0] = 10.0
    assert select_forecast_ref(f, kc, pos, topk=4, **kw)[0, 0, 0].tolist() == [0, 2, 4, 5]
    # f = [-1, 0]: logits c4 = -1/sqrt2, c3 = c5 = -0.5/sqrt2, others 0.
    #   block1 = max(c1,c2,c3) = 0, block2 = max(c3,c4,c5) = -0.354, block3 = max(c5,c6,c7) = 0.
    # Negative logits are still finite, hence eligible. topk 4: blocks 1, 3 tie at 0 -> block 1.
    f[0, 0, 0, 0] = -1.0
    assert select_forecast_ref(f, kc, pos, topk=4, **kw)[0, 0, 0].tolist() == [0, 1, 4, 5]
    # topk 5: block 3 next (0 > -0.354).
    assert select_forecast_ref(f, kc, pos, topk=5, **kw)[0, 0, 0].tolist() == [0, 1, 3, 4, 5]
    # The chunk scores are the raw scaled logits.
    S = forecast_chunk_scores_ref(f, kc, pos, kernel_size=4, stride=2)
    np.testing.assert_allclose(S[0, 0, 0, 3:6], [-0.5 / math.sqrt(2), -1 / math.sqrt(2),
                                                 -0.5 / math.sqrt(2)])


def test_ref_group_sum_no_division():
    # q = 0 -> every logit is 0 -> each head's softmax is uniform over the n_vis visible chunks,
    # p_h(c) = 1/n_vis, and the group score is G/n_vis (summed, not averaged); invisible -> -inf.
    # T = 24, kernel 4 stride 2: N_c = 11. p = 9: visible 2c+3 <= 9 -> c <= 3 -> n_vis = 4.
    G = 3
    k = np.random.default_rng(0).normal(size=(1, 24, 1, 2))
    kc = compress_keys_ref(k, 4, 2)
    q = np.zeros((1, 1, G, 2))
    S = infllmv2_chunk_scores_ref(q, kc, np.array([[9]]), kernel_size=4, stride=2)
    np.testing.assert_allclose(S[0, 0, 0, :4], [G / 4] * 4)
    assert np.all(S[0, 0, 0, 4:] == -np.inf)


def test_ref_coarse_lse():
    # Same q = 0 trick. Fine (4, 2): N_c = 11 ; coarse (8, 4): N_c2 = (24-8)//4 + 1 = 5.
    # p = 23: fine visible all 11, coarse visible 4c2+7 <= 23 -> c2 <= 4 -> all 5.
    #   exact: p_h = exp(0 - log 11) = 1/11 ; coarse: p_h = exp(0 - log 5) = 1/5.
    # p = 5: fine visible c <= 1 (2 chunks); coarse needs 4c2+7 <= 5 -> none -> fallback to exact:
    #   p_h = 1/2.
    k = np.random.default_rng(1).normal(size=(1, 24, 1, 2))
    kc = compress_keys_ref(k, 4, 2)
    q = np.zeros((1, 2, 1, 2))
    pos = np.array([[23, 5]])
    S_exact = infllmv2_chunk_scores_ref(q, kc, pos, kernel_size=4, stride=2)
    S_coarse = infllmv2_chunk_scores_ref(q, kc, pos, kernel_size=4, stride=2, coarse_lse=(8, 4),
                                         k_raw=k)
    np.testing.assert_allclose(S_exact[0, 0, 0], [1 / 11] * 11)
    np.testing.assert_allclose(S_coarse[0, 0, 0], [1 / 5] * 11)
    np.testing.assert_allclose(S_coarse[0, 0, 1, :2], [0.5, 0.5])
    np.testing.assert_allclose(S_exact[0, 0, 1, :2], [0.5, 0.5])
    # With the coarse compression equal to the fine one, it is the exact computation.
    rng = np.random.default_rng(2)
    q = rng.normal(size=(1, 3, 4, 2))
    pos = np.array([[23, 12, 3]])
    np.testing.assert_allclose(
        infllmv2_chunk_scores_ref(q, kc, pos, kernel_size=4, stride=2, coarse_lse=(4, 2), k_raw=k),
        infllmv2_chunk_scores_ref(q, kc, pos, kernel_size=4, stride=2))


def test_ref_early_positions_forced_and_padding():
    k = np.random.default_rng(3).normal(size=(1, 24, 1, 2))
    kc = compress_keys_ref(k, 4, 2)
    q = np.random.default_rng(4).normal(size=(1, 4, 1, 2))
    kw = dict(block_size=4, init_blocks=1, local_blocks=1, kernel_size=4, stride=2, topk=4)
    # p = 0, 2: q_blk = 0, no visible chunk (2c+3 <= 2 has no c >= 0) -> only forced block 0.
    # p = 5: q_blk = 1, forced {0} u {0, 1}; only 2 candidates -> [0, 1, -1, -1].
    # p = 9: q_blk = 2, forced {0, 1, 2}; 3 candidates -> [0, 1, 2, -1].
    pos = np.array([[0, 2, 5, 9]])
    ids = select_infllmv2_ref(q, kc, pos, **kw)
    assert ids.dtype == np.int32 and ids.shape == (1, 1, 4, 4)
    assert ids[0, 0].tolist() == [[0, -1, -1, -1], [0, -1, -1, -1], [0, 1, -1, -1],
                                  [0, 1, 2, -1]]
    # No init block, local 0: the current block is still forced (q_blk - 0 <= k <= q_blk).
    ids = select_infllmv2_ref(q, kc, pos, block_size=4, init_blocks=0, local_blocks=0,
                              kernel_size=4, stride=2, topk=4)
    # p = 0, 2: block 0 forced. p = 5: block 1 forced; visible c0 (tokens 0..3), c1 (2..5) both
    # overlap block 0 -> block 0 finite -> [0, 1]. p = 9: block 2 forced; visible c <= 3 cover
    # blocks 0 and 1 -> [0, 1, 2].
    assert ids[0, 0].tolist() == [[0, -1, -1, -1], [0, -1, -1, -1], [0, 1, -1, -1],
                                  [0, 1, 2, -1]]


def test_ref_block_without_visible_chunk_never_chosen():
    # block_size 4, kernel 8, stride 8: chunk c = tokens [8c, 8c+8) = blocks 2c and 2c+1.
    # p = 13: q_blk = 3; visible 8c+7 <= 13 -> only c0. Blocks 0, 1 score p(c0) = 1; block 2
    # (tokens 8..11) is covered only by c1, invisible -> -inf. init 0, local 0 -> forced {3}.
    # topk 4: {3} forced + blocks 0, 1; block 2 is -inf -> padded: [0, 1, 3, -1].
    k = np.random.default_rng(5).normal(size=(1, 16, 1, 2))
    kc = compress_keys_ref(k, 8, 8)
    assert kc.shape[1] == 2
    q = np.random.default_rng(6).normal(size=(1, 1, 2, 2))
    ids = select_infllmv2_ref(q, kc, np.array([[13]]), block_size=4, init_blocks=0,
                              local_blocks=0, topk=4, kernel_size=8, stride=8)
    assert ids[0, 0, 0].tolist() == [0, 1, 3, -1]
    ids = select_forecast_ref(q[:, :, :1], kc, np.array([[13]]), block_size=4, init_blocks=0,
                              local_blocks=0, topk=4, kernel_size=8, stride=8)
    assert ids[0, 0, 0].tolist() == [0, 1, 3, -1]


def test_ref_more_forced_than_topk_keeps_lowest():
    # p = 23, block 4 -> q_blk 5; init 1, local 3 -> forced {0, 2, 3, 4, 5} (5 blocks) > topk 3.
    # All +inf: tie-break by lower index -> [0, 2, 3].
    k = np.random.default_rng(7).normal(size=(1, 24, 1, 2))
    kc = compress_keys_ref(k, 4, 2)
    q = np.random.default_rng(8).normal(size=(1, 1, 1, 2))
    ids = select_infllmv2_ref(q, kc, np.array([[23]]), block_size=4, init_blocks=1,
                              local_blocks=3, topk=3, kernel_size=4, stride=2)
    assert ids[0, 0, 0].tolist() == [0, 2, 3]


def test_ref_single_head_softmax_matches_forecast():
    # One query head per group: softmax is monotone, so InfLLM-V2 and Forecast rank identically.
    rng = np.random.default_rng(9)
    T, K, D = 40, 2, 4
    k = rng.normal(size=(2, T, K, D))
    kc = compress_keys_ref(k, 4, 2)
    q = rng.normal(size=(2, 5, K, D))
    pos = np.array([[39, 30, 17, 8, 3], [39, 38, 25, 12, 0]])
    kw = dict(block_size=4, init_blocks=1, local_blocks=1, topk=5, kernel_size=4, stride=2)
    np.testing.assert_array_equal(select_infllmv2_ref(q, kc, pos, **kw),
                                  select_forecast_ref(q, kc, pos, **kw))


def test_ref_nosa_select():
    # p = 29, block 4 -> q_blk 7; init 1, local 1 -> forced {0, 6, 7}.
    # qk scores [0, 5, 1, 9, 2, 3, 0, 0]: stage 1 (qk_topk 4) = forced + best other = block 3.
    # cis scores [1, 2, 8, 0, 7, -inf, 0, 0] -> stage-1 blocks {0, 3, 6, 7} set to +inf.
    #   topk 6: 4 at +inf, then block 2 (8), block 4 (7) -> [0, 2, 3, 4, 6, 7].
    #   topk 8: then block 1 (2); block 5 is -inf, never chosen -> [0, 1, 2, 3, 4, 6, 7, -1].
    qk = np.array([0, 5, 1, 9, 2, 3, 0, 0], dtype=np.float64).reshape(1, 1, 1, 8)
    cis = np.array([1, 2, 8, 0, 7, -np.inf, 0, 0]).reshape(1, 1, 1, 8)
    pos = np.array([[29]])
    kw = dict(block_size=4, init_blocks=1, local_blocks=1, qk_topk=4)
    assert nosa_select_ref(qk, cis, pos, topk=6, **kw)[0, 0, 0].tolist() == [0, 2, 3, 4, 6, 7]
    assert nosa_select_ref(qk, cis, pos, topk=8, **kw)[0, 0, 0].tolist() == [0, 1, 2, 3, 4, 6, 7,
                                                                              -1]
    # Causality: p = 13 -> q_blk 3, forced {0, 2, 3}; qk_topk 4 adds block 1 (the only other candidate). Block 5's
    # huge cis score is in the future and is never chosen -> [0, 1, 2, 3, -1, -1].
    cis2 = np.array([1, 2, 8, 0, 7, 100, 0, 0], dtype=np.float64).reshape(1, 1, 1, 8)
    assert nosa_select_ref(qk, cis2, np.array([[13]]), topk=6, **kw)[0, 0, 0].tolist() == [
        0, 1, 2, 3, -1, -1]


def test_ref_cis_block_scores():
    # cis[t] = t, T = 12, kernel 4, stride 2 -> N_c = 5, cc[c] = mean(2c..2c+3) = 2c + 1.5.
    # Block k pools c in {2k-1, 2k, 2k+1}.
    # p = 11: all c visible (2c+3 <= 11 -> c <= 4):
    #   block0 = max(c0, c1) = 3.5, block1 = max(c1, c2, c3) = 7.5, block2 = max(c3, c4) = 9.5,
    #   block3 -> chunks 5.. do not exist -> -inf.
    # p = 6: visible c <= 1: block0 = 3.5, block1 = c1 = 3.5, block2 = -inf, block3 = -inf.
    cis = np.arange(12, dtype=np.float64).reshape(1, 12, 1)
    out = cis_block_scores_ref(cis, 4, block_size=4, kernel_size=4, stride=2,
                               q_positions=np.array([[11, 6]]))
    assert out.shape == (1, 1, 2, 4)
    np.testing.assert_allclose(out[0, 0, 0], [3.5, 7.5, 9.5, -np.inf])
    np.testing.assert_allclose(out[0, 0, 1], [3.5, 3.5, -np.inf, -np.inf])


def _random_attn(seed, B=2, Tq=5, H=4, K=2, S=19, D=3):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, Tq, H, D))
    k = rng.normal(size=(B, S, K, D))
    v = rng.normal(size=(B, S, K, D))
    pos = rng.integers(0, S, size=(B, Tq))
    bias = rng.normal(size=(B, S, K))
    return q, k, v, pos, bias


def test_ref_sparse_all_blocks_equals_dense():
    q, k, v, pos, bias = _random_attn(10)
    B, Tq, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    bs = 4
    n_blk = (S + bs - 1) // bs  # 5 blocks, the last one partial (tokens 16..18)
    ids = np.full((B, K, Tq, n_blk + 2), -1, dtype=np.int32)
    ids[..., :n_blk] = np.arange(n_blk)
    for bb in (None, bias):
        np.testing.assert_allclose(
            sparse_attention_ref(q, k, v, ids, pos, bb, block_size=bs),
            dense_attention_ref(q, k, v, pos, bb), rtol=1e-12, atol=1e-12)


def test_ref_sparse_duplicates_and_hand_cases():
    q, k, v, pos, bias = _random_attn(11, B=1, Tq=3, H=2, K=1, S=12)
    pos = np.array([[4, 2, 11]])
    bs = 4
    # Query 0 at p = 4 selects only block 1 (tokens 4..7): causal -> only key 4 -> out = v[4].
    # Query 1 at p = 2 selects only block 2 (future, tokens 8..11): nothing attended -> out = 0.
    # Query 2 at p = 11 selects blocks [1, 1, 2] -> same as [1, 2] (duplicates count once).
    ids = np.array([[[[1, -1, -1], [2, -1, -1], [1, 1, 2]]]], dtype=np.int32)
    out = sparse_attention_ref(q, k, v, ids, pos, bias, block_size=bs)
    for h in range(2):
        np.testing.assert_allclose(out[0, 0, h], v[0, 4, 0])
        np.testing.assert_allclose(out[0, 1, h], 0.0)
    ids_nodup = np.array([[[[1, -1, -1], [2, -1, -1], [1, 2, -1]]]], dtype=np.int32)
    np.testing.assert_allclose(out, sparse_attention_ref(q, k, v, ids_nodup, pos, bias,
                                                         block_size=bs))
    # Query 2 by hand: softmax over keys 4..11 with bias.
    for h in range(2):
        logits = np.array([q[0, 2, h] @ k[0, j, 0] / math.sqrt(3) + bias[0, j, 0]
                           for j in range(4, 12)])
        w = np.exp(logits - logits.max())
        w /= w.sum()
        np.testing.assert_allclose(out[0, 2, h], w @ v[0, 4:12, 0])


def test_ref_dense_uniform_average():
    # q = 0 and no bias -> all logits equal -> out = mean of v[0..p].
    _, k, v, _, _ = _random_attn(12, B=1, Tq=2, H=2, K=1, S=10)
    q = np.zeros((1, 2, 2, 3))
    pos = np.array([[0, 6]])
    out = dense_attention_ref(q, k, v, pos)
    for h in range(2):
        np.testing.assert_allclose(out[0, 0, h], v[0, 0, 0])
        np.testing.assert_allclose(out[0, 1, h], v[0, :7, 0].mean(axis=0))
