"""The specification, written like the specification: numpy, float64, loops allowed.

Self-attention with relative position representations (Shaw, Uszkoreit & Vaswani, "Self-Attention with
Relative Position Representations", NAACL 2018), written out: clipped relative positions, the key term added
to the scores, the value term added to the output. Every fast path in :mod:`relattn` is tested
against the functions here, and the loop forms here are the ground truth for the vectorised forms.

Notation: ``N`` query length, ``M`` key length, ``d_k``/``d_v`` head dims, ``K`` the maximum
relative position (the table has ``2K + 1`` rows: offset ``r`` in ``[-K, K]`` lives at row ``r + K``).

Two variants the published models use extend the spec: a window ``(left, right)`` of offsets ``[-left, right]``
(rows ``0 .. left + right``, offset ``r`` at row ``r + left``; ``K`` is ``(K, K)``), and ``beyond="zero"``:
offsets outside the window have no embedding (a zero vector) instead of the edge row.

A third table, ``a_Q`` (position-to-content: DeBERTa's p2c term, BERT's ``relative_key_query``), adds
``k_j . a^Q_{j-i}`` to the score of query ``i`` and key ``j``, at the same row of the same offset ``j - i`` as
``a^K``: ``e_ij = (q_i . k_j + q_i . a^K_{j-i} + k_j . a^Q_{j-i}) * scale``.

Transformer-XL (Dai et al., 2019, appendix B; the Conformer's ``RelPositionMultiHeadAttention``) adds two learned
vectors per head: the content bias ``u`` on the content term and the position bias ``v`` on the key-table term,
``e_ij = ((q_i + u) . k_j + (q_i + v) . a^K_{j-i} + k_j . a^Q_{j-i}) * scale``, its table covering every offset of
the sequence (a window ``K >= N - 1``).

T5 (Raffel et al., 2020) and MPNet add a learned scalar per head and offset, ``b_{j-i}``, to the scores, unscaled,
read at the same row as ``a^K``: ``e_ij = (q_i . k_j + q_i . a^K_{j-i} + k_j . a^Q_{j-i}) * scale + b_{j-i}`` (T5 itself
has no tables and ``scale = 1``). T5's row of an offset is its bucket (:func:`t5_bucket`: exact near, log-spaced up
to ``max_distance``, split by sign or causal); a window ``K`` past the buckets' saturation clips to the same rows.

Seeding: the spec seeds numpy's *global* generator. Here every random draw goes through a local
``np.random.RandomState`` built from ``seed`` (legacy ``RandomState(s)`` draws exactly what
``np.random.seed(s)`` followed by ``np.random.randn`` draws), so the spec's printed numbers are
reproduced without this module ever touching global RNG state.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "clip_relative_position",
    "relative_position_matrix",
    "RelativePositionEmbedding",
    "relative_attention_scores",
    "relative_attention_scores_vectorized",
    "relative_attention_output",
    "relative_attention_output_vectorized",
    "softmax",
    "RelativeSelfAttention",
    "relative_attention",
    "relative_attention_varlen",
    "t5_bucket",
]


def t5_bucket(rel_pos: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True) -> int:
    """T5's bucket of the offset ``rel_pos = j - i`` (its ``memory_position - context_position``), literally as
    Mesh TensorFlow and transformers' ``_relative_position_bucket`` compute it (the log in float32)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if rel_pos > 0 else 0
        n = abs(rel_pos)
    else:
        n = max(-rel_pos, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    ratio = np.float32(np.log(np.float32(n) / np.float32(max_exact)))
    large = max_exact + int(ratio / np.float32(np.log(max_distance / max_exact)) * np.float32(num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


def _is_t5(positions) -> bool:
    return all(hasattr(positions, a) for a in ("num_buckets", "max_distance", "bidirectional"))


def _check_window(max_relative_position) -> tuple[int, int]:
    """``(left, right)`` from an int ``K`` or a pair."""
    if isinstance(max_relative_position, (tuple, list)):
        left, right = (_check_k(x) for x in max_relative_position)
        return left, right
    k = _check_k(max_relative_position)
    return k, k


def _check_k(max_relative_position: int) -> int:
    if isinstance(max_relative_position, bool) or not isinstance(max_relative_position, (int, np.integer)):
        raise TypeError(f"max_relative_position must be an int, got {type(max_relative_position).__name__}")
    if max_relative_position < 0:
        raise ValueError(f"max_relative_position must be >= 0, got {max_relative_position}")
    return int(max_relative_position)


def _rng(seed: int | None, rng: np.random.RandomState | np.random.Generator | None):
    if seed is not None and rng is not None:
        raise ValueError("pass seed or rng, not both")
    if rng is not None:
        return rng
    if seed is not None:
        return np.random.RandomState(seed)
    return np.random.default_rng()


def _randn(rng, *shape: int) -> np.ndarray:
    if isinstance(rng, np.random.RandomState):
        return rng.randn(*shape)
    return rng.standard_normal(shape)


def clip_relative_position(j: int, i: int, max_dist: int) -> int:
    """Clipped relative position of key ``j`` seen from query ``i``: ``clip(j - i, -max_dist, max_dist)``."""
    max_dist = _check_k(max_dist)
    rel_pos = j - i
    return max(-max_dist, min(max_dist, rel_pos))


def relative_position_matrix(query_len: int, key_len: int, max_dist: int, *, query_offset: int = 0) -> np.ndarray:
    """``(N, M)`` int matrix of clipped offsets ``clip(j - (i + query_offset), -K, K)`` (not shifted)."""
    out = np.empty((query_len, key_len), dtype=np.int64)
    for i in range(query_len):
        for j in range(key_len):
            out[i, j] = clip_relative_position(j, i + query_offset, max_dist)
    return out


class RelativePositionEmbedding:
    """The two learned tables of the spec: ``a_K`` (2K+1, d_k) for keys and ``a_V`` (2K+1, d_v) for values.

    Rows are initialised ``N(0, 1) * sqrt(2 / (2K + 1 + d))`` (Glorot-normal scale), keys first, then
    values, from ``RandomState(seed)`` when ``seed`` is given (as the spec's ``np.random.seed(seed)``).
    ``max_distance`` may be a window ``(left, right)`` (tables of ``left + right + 1`` rows), and
    ``beyond="zero"`` gives offsets outside the window a zero embedding instead of the edge row.
    """

    def __init__(self, max_distance, d_k: int, d_v: int, seed: int | None = None, *, rng=None,
                 beyond: str = "clip"):
        self.max_left, self.max_right = _check_window(max_distance)
        if beyond not in ("clip", "zero"):
            raise ValueError(f"beyond must be 'clip' or 'zero', got {beyond!r}")
        gen = _rng(seed, rng)
        n_positions = self.max_left + self.max_right + 1
        scale_k = np.sqrt(2.0 / (n_positions + d_k))
        scale_v = np.sqrt(2.0 / (n_positions + d_v))
        self.a_K = _randn(gen, n_positions, d_k) * scale_k
        self.a_V = _randn(gen, n_positions, d_v) * scale_v
        self.a_Q = None  # no position-to-content term unless given (from_tables)
        self.b = None  # no scalar bias unless given (from_tables)
        self.buckets = None  # T5's buckets (num_buckets, max_distance, bidirectional) in place of the window
        self.beyond = beyond

    @classmethod
    def from_tables(cls, a_K, a_V, max_distance, *, beyond: str = "clip", a_Q=None, b=None,
                    buckets=None) -> RelativePositionEmbedding:
        """Given tables (``left + right + 1`` rows each) instead of drawn ones; ``a_Q`` (rows as ``a_K``) or None;
        ``b`` (rows,), the scalar bias, or None. ``buckets``: ``(num_buckets, max_distance, bidirectional)``, T5's
        map of offsets to the tables' ``num_buckets`` rows (:func:`t5_bucket`) in place of the window."""
        emb = cls(max_distance, 1, 1, rng=np.random.RandomState(0), beyond=beyond)
        emb.a_K, emb.a_V = np.asarray(a_K, dtype=np.float64), np.asarray(a_V, dtype=np.float64)
        emb.a_Q = None if a_Q is None else np.asarray(a_Q, dtype=np.float64)
        emb.b = None if b is None else np.asarray(b, dtype=np.float64)
        emb.buckets = buckets
        return emb

    @property
    def max_distance(self) -> int:
        """``K`` of a symmetric window."""
        if self.max_left != self.max_right:
            raise ValueError(f"the window ({self.max_left}, {self.max_right}) is not symmetric")
        return self.max_left

    def index(self, rel_pos: int) -> int | None:
        """Row of the table for a raw offset ``j - i``: clip to ``[-left, right]``, then shift by ``left``; None
        (no embedding) outside the window when ``beyond="zero"``; T5's bucket with ``buckets``."""
        if self.buckets is not None:
            return t5_bucket(rel_pos, *self.buckets)
        if self.beyond == "zero" and not -self.max_left <= rel_pos <= self.max_right:
            return None
        return max(-self.max_left, min(self.max_right, rel_pos)) + self.max_left

    def _row(self, table: np.ndarray, rel_pos: int) -> np.ndarray:
        row = self.index(rel_pos)
        return np.zeros(table.shape[1]) if row is None else table[row]

    def get_key_embedding(self, rel_pos: int) -> np.ndarray:
        """``a^K`` for the raw offset ``rel_pos = j - i``."""
        return self._row(self.a_K, rel_pos)

    def get_value_embedding(self, rel_pos: int) -> np.ndarray:
        """``a^V`` for the raw offset ``rel_pos = j - i``."""
        return self._row(self.a_V, rel_pos)

    def get_query_embedding(self, rel_pos: int) -> np.ndarray | None:
        """``a^Q`` (position-to-content) for the raw offset ``rel_pos = j - i``; None without that table."""
        return None if self.a_Q is None else self._row(self.a_Q, rel_pos)

    def get_bias(self, rel_pos: int) -> float:
        """The scalar bias ``b`` for the raw offset ``rel_pos = j - i``; 0 without it (or outside a zero-beyond
        window)."""
        if self.b is None:
            return 0.0
        row = self.index(rel_pos)
        return 0.0 if row is None else float(self.b[row])

    def index_matrix(self, n: int, m: int, *, query_offset: int = 0) -> np.ndarray:
        """(N, M) rows of :meth:`index`, with ``left + right + 1`` (one past the last row) for None."""
        rows = self.buckets[0] if self.buckets is not None else self.max_left + self.max_right + 1
        out = np.empty((n, m), dtype=np.int64)
        for i in range(n):
            for j in range(m):
                row = self.index(j - (i + query_offset))
                out[i, j] = rows if row is None else row
        return out


def _with_zero_row(table: np.ndarray) -> np.ndarray:
    return np.vstack([table, np.zeros((1, table.shape[1]))])


def relative_attention_scores(Q, K, rel_embed: RelativePositionEmbedding, *, query_offset: int = 0, scale=None,
                              content_bias=None, position_bias=None):
    """Loop form: ``e_ij = ((q_i + u) . k_j + (q_i + v) . a^K_{j-i} [+ k_j . a^Q_{j-i}]) * scale [+ b_{j-i}]``, scale
    ``1/sqrt(d_k)`` by default; the bracketed position-to-content term when ``rel_embed`` has an ``a_Q`` table, the
    scalar bias (unscaled) when it has ``b``;
    ``u`` = ``content_bias`` and ``v`` = ``position_bias`` (d_k,) (Transformer-XL's), zero when None.

    Q (N, d_k), K (M, d_k) -> (N, M). Query ``i`` sits at absolute position ``i + query_offset``.
    """
    n, d_k = Q.shape
    m = K.shape[0]
    u = np.zeros(d_k) if content_bias is None else np.asarray(content_bias, dtype=np.float64)
    v = np.zeros(d_k) if position_bias is None else np.asarray(position_bias, dtype=np.float64)
    scores = np.zeros((n, m))
    for i in range(n):
        for j in range(m):
            content_score = np.dot(Q[i] + u, K[j])
            a_k = rel_embed.get_key_embedding(j - (i + query_offset))
            scores[i, j] = content_score + np.dot(Q[i] + v, a_k)
            a_q = rel_embed.get_query_embedding(j - (i + query_offset))
            if a_q is not None:
                scores[i, j] += np.dot(K[j], a_q)
    bias = np.array([[rel_embed.get_bias(j - (i + query_offset)) for j in range(m)] for i in range(n)]).reshape(n, m)
    return scores * (1.0 / np.sqrt(d_k) if scale is None else scale) + bias


def relative_attention_scores_vectorized(Q, K, rel_embed, *, query_offset: int = 0, scale=None, content_bias=None,
                                         position_bias=None):
    """Same as :func:`relative_attention_scores`, by gathering ``(Q + v) @ a_K.T`` (and ``K @ a_Q.T``) through the
    index matrix."""
    n, d_k = Q.shape
    m = K.shape[0]
    u = 0.0 if content_bias is None else np.asarray(content_bias, dtype=np.float64)
    v = 0.0 if position_bias is None else np.asarray(position_bias, dtype=np.float64)
    idx = rel_embed.index_matrix(n, m, query_offset=query_offset)
    rel = ((Q + v) @ _with_zero_row(rel_embed.a_K).T)[np.arange(n)[:, None], idx]
    if rel_embed.a_Q is not None:
        rel = rel + (K @ _with_zero_row(rel_embed.a_Q).T)[np.arange(m)[None, :], idx]
    bias = 0.0 if rel_embed.b is None else np.append(rel_embed.b, 0.0)[idx]
    return ((Q + u) @ K.T + rel) * (1.0 / np.sqrt(d_k) if scale is None else scale) + bias


def relative_attention_output(attention_weights, V, rel_embed: RelativePositionEmbedding, *, query_offset: int = 0):
    """Loop form: ``out_i = sum_j w_ij (v_j + a^V_{j-i})``. weights (N, M), V (M, d_v) -> (N, d_v)."""
    n, m = attention_weights.shape
    output = np.zeros((n, V.shape[1]))
    for i in range(n):
        for j in range(m):
            a_v = rel_embed.get_value_embedding(j - (i + query_offset))
            output[i] += attention_weights[i, j] * (V[j] + a_v)
    return output


def relative_attention_output_vectorized(attention_weights, V, rel_embed, *, query_offset: int = 0):
    """Same as :func:`relative_attention_output`: per-row bucket sums of the weights times ``a_V``."""
    n, m = attention_weights.shape
    idx = rel_embed.index_matrix(n, m, query_offset=query_offset)
    a_v = _with_zero_row(rel_embed.a_V)
    buckets = np.zeros((n, a_v.shape[0]))
    np.add.at(buckets, (np.repeat(np.arange(n), m), idx.ravel()), attention_weights.ravel())
    return attention_weights @ V + buckets @ a_v


def softmax(scores):
    """Row softmax; a row that is ``-inf`` everywhere (nothing to attend to) gives zeros, not NaN, and a NaN score
    makes its whole row NaN (as ``torch.softmax``): a NaN total is never taken for an empty row."""
    if scores.shape[-1] == 0:  # no keys: nothing to attend to
        return np.zeros_like(scores, dtype=np.float64)
    peak = scores.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(scores - peak)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total == 0, 1.0, total)


class RelativeSelfAttention:
    """The spec's single-head layer: projections ``W_q, W_k`` (embed_dim, d_k), ``W_v`` (embed_dim, d_v).

    Projections are drawn ``N(0,1) * sqrt(2 / (embed_dim + d))`` from ``RandomState(seed)`` in the order
    W_q, W_k, W_v; the tables are then drawn from a *fresh* ``RandomState(seed)``, as the spec reseeds.
    """

    def __init__(self, embed_dim: int, d_k: int, d_v: int, max_distance: int = 16, seed: int | None = None):
        gen = _rng(seed, None)
        scale_qk = np.sqrt(2.0 / (embed_dim + d_k))
        scale_v = np.sqrt(2.0 / (embed_dim + d_v))
        self.W_q = _randn(gen, embed_dim, d_k) * scale_qk
        self.W_k = _randn(gen, embed_dim, d_k) * scale_qk
        self.W_v = _randn(gen, embed_dim, d_v) * scale_v
        self.rel_embed = RelativePositionEmbedding(max_distance, d_k, d_v, seed)
        self.d_k = d_k

    def forward(self, X):
        """X (N, embed_dim) -> output (N, d_v), attention weights (N, N)."""
        Q, K, V = X @ self.W_q, X @ self.W_k, X @ self.W_v
        weights = softmax(relative_attention_scores(Q, K, self.rel_embed))
        return relative_attention_output(weights, V, self.rel_embed), weights


def _mask_scores(attn_mask, is_causal, shape, query_offset):
    """(B, H, N, M) scores to add: ``attn_mask`` (bool True = may attend, or float added) and the causal pattern."""
    n, m = shape[-2:]
    bias = np.zeros(shape)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        bias = bias + (np.where(mask, 0.0, -np.inf) if mask.dtype == bool else mask)
    if is_causal:
        future = np.arange(m)[None, :] > np.arange(n)[:, None] + query_offset
        bias = np.where(future, -np.inf, bias)
    return bias


def relative_attention(q, k, v, rel_k=None, rel_v=None, *, max_relative_position, rel_q=None, content_bias=None,
                       position_bias=None, rel_bias=None, beyond="clip", attn_mask=None, is_causal=False, scale=None,
                       query_offset=0, return_weights=False):
    """Batched multi-head reference for the torch op, built from the spec's functions above.

    q (B, H, N, D), k (B, H, M, D), v (B, H, M, Dv); rel_k/rel_v/rel_q (R, D) or (H, R, D) or None, R = 2K+1 rows
    (``left + right + 1`` for a window ``max_relative_position=(left, right)``); ``beyond`` as in
    :class:`RelativePositionEmbedding`; content_bias/position_bias (H, D) or None, Transformer-XL's ``u`` and
    ``v``, one row per head (:func:`relative_attention_scores`); rel_bias (R,) or (H, R) or None, the scalar bias
    added unscaled at the same row; ``max_relative_position`` may also be T5's buckets (anything with
    ``num_buckets``, ``max_distance``, ``bidirectional``, as :class:`relattn.positions.T5Buckets`): R = num_buckets
    rows, each offset's row its bucket (:func:`t5_bucket`); attn_mask bool (True = may attend) or float (added),
    broadcastable to (B, H, N, M). Fully masked rows give zero output. Returns (B, H, N, Dv) float64 [and weights]."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    buckets = None
    if _is_t5(max_relative_position):
        t5 = max_relative_position
        buckets = (t5.num_buckets, t5.max_distance, t5.bidirectional)
        left, right, rows = 0, 0, t5.num_buckets
    else:
        left, right = _check_window(max_relative_position)
        rows = left + right + 1
    tables = []
    for t, dim in ((rel_k, d), (rel_v, dv)):
        t = np.zeros((h, rows, dim)) if t is None else np.asarray(t, dtype=np.float64)
        tables.append(np.broadcast_to(t, (h, rows, dim)))
    rel_q = None if rel_q is None else np.broadcast_to(np.asarray(rel_q, dtype=np.float64), (h, rows, d))
    rel_bias = None if rel_bias is None else np.broadcast_to(np.asarray(rel_bias, dtype=np.float64), (h, rows))
    # A table row that no pair the call may attend meets (an offset beyond the keys, or after the query under
    # is_causal) is never read: a NaN there reaches nothing (not every row by 0 * NaN through a zero weight).
    allowed = np.ones((n, m), dtype=bool)
    if is_causal:
        allowed = np.arange(m)[None, :] <= np.arange(n)[:, None] + query_offset
    emb = RelativePositionEmbedding.from_tables(np.zeros((rows, 1)), np.zeros((rows, 1)), (left, right), beyond=beyond,
                                          buckets=buckets)
    met = np.zeros(rows + 1, dtype=bool)
    met[emb.index_matrix(n, m, query_offset=query_offset)[allowed]] = True
    tables = [np.where(met[:rows, None], t, 0.0) for t in tables]
    rel_q = None if rel_q is None else np.where(met[:rows, None], rel_q, 0.0)
    rel_bias = None if rel_bias is None else np.where(met[None, :rows], rel_bias, 0.0)
    biases = [None if t is None else np.broadcast_to(np.asarray(t, dtype=np.float64), (h, d))
              for t in (content_bias, position_bias)]
    bias = _mask_scores(attn_mask, is_causal, (b, h, n, m), query_offset)
    out = np.zeros((b, h, n, dv))
    weights = np.zeros((b, h, n, m))
    for bi in range(b):
        for hi in range(h):
            emb = RelativePositionEmbedding.from_tables(tables[0][hi], tables[1][hi], (left, right), beyond=beyond,
                                                        a_Q=None if rel_q is None else rel_q[hi],
                                                        b=None if rel_bias is None else rel_bias[hi], buckets=buckets)
            s = relative_attention_scores_vectorized(
                q[bi, hi], k[bi, hi], emb, query_offset=query_offset, scale=scale,
                content_bias=None if biases[0] is None else biases[0][hi],
                position_bias=None if biases[1] is None else biases[1][hi])
            weights[bi, hi] = softmax(s + bias[bi, hi])
            out[bi, hi] = relative_attention_output_vectorized(weights[bi, hi], v[bi, hi], emb,
                                                               query_offset=query_offset)
    return (out, weights) if return_weights else out


def relative_attention_varlen(q, k, v, rel_k=None, rel_v=None, *, cu_seqlens_q, cu_seqlens_k=None,
                              max_relative_position, rel_q=None, content_bias=None, position_bias=None,
                              rel_bias=None, beyond="clip", is_causal=False, scale=None):
    """Packed sequences, one after another: q (T, H, D), k (T_k, Hkv, D), v (T_k, Hkv, Dv) with ``H % Hkv == 0``
    (query head ``h`` reads key/value head ``h // (H // Hkv)``); sequence ``s`` holds the query rows
    ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1`` and the key rows of ``cu_seqlens_k`` (None: ``cu_seqlens_q``)
    likewise. Positions count within each sequence, and its ``n`` queries sit at the end of its ``m`` keys: the
    sequence is :func:`relative_attention` with ``query_offset = m - n`` (causal: key ``j`` at most query ``i``'s
    position ``i + m - n``). Returns (T, H, Dv) float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    cu_q = [int(x) for x in np.asarray(cu_seqlens_q)]
    cu_k = cu_q if cu_seqlens_k is None else [int(x) for x in np.asarray(cu_seqlens_k)]
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    for s in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = (cu_q[s], cu_q[s + 1]), (cu_k[s], cu_k[s + 1])
        if q1 == q0:
            continue
        one = relative_attention(*(x[None].transpose(0, 2, 1, 3) for x in (q[q0:q1], k[k0:k1], v[k0:k1])), rel_k,
                                 rel_v, max_relative_position=max_relative_position, rel_q=rel_q,
                                 content_bias=content_bias, position_bias=position_bias, rel_bias=rel_bias,
                                 beyond=beyond, is_causal=is_causal, scale=scale, query_offset=(k1 - k0) - (q1 - q0))
        out[q0:q1] = one[0].transpose(1, 0, 2)
    return out
