"""The "dense" backend: (B, H, N, M) scores, never an (N, M, D) tensor. Any device, dtype, mask (one that needs
a gradient included) and dropout; the fastest for small problems.

Key term: ``q @ rel_k.T`` is (B, H, N, 2K+1) -- the Toeplitz structure of the clipped offsets means
each query needs only 2K+1 dot products with the table -- gathered through the (N, M) index (``q_pos @ rel_k.T``
when the call carries position queries: Transformer-XL's position bias).
Position-to-content term: ``k @ rel_q.T`` is (B, H, M, 2K+1), gathered through the transposed index: key ``j``
against the row ``idx_ij`` of each query.
Scalar bias (T5's): ``rel_bias`` (Hr, 2K+1) gathered through the index, added after the scale.
Value term: per-row bucket sums of the weights, (B, H, N, 2K+1), times ``rel_v``.
Dropout: the weights times every backend's keep mask (``_common.dropout_keep``), computed over the whole (B, H, N, M).
"""

from __future__ import annotations

import torch

from ..positions import causal_allowed, relative_position_index, unmet_rows_zeroed
from ._common import AttentionCall, Backend, Serves, call_seed, keep_scale


def masked_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where a row of all ``-inf`` (or of no keys) gives zeros and zero gradients."""
    if scores.shape[-1] == 0:
        return scores
    peak = scores.detach().amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    e = torch.exp(scores - peak)
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)  # a NaN total stays NaN


def dense_weights(q, k, rel_k, *, max_relative_position, mask, is_causal, scale, query_offset, rel_q=None,
                  q_pos=None, rel_bias=None):
    """Attention weights (B, H, N, M) before dropout, and the (N, M) relative index; the key table is read by
    ``q_pos`` when given, else by ``q``."""
    n, m = q.shape[-2], k.shape[-2]
    idx = relative_position_index(n, m, max_relative_position, query_offset=query_offset, device=q.device)
    rel_k, rel_q = (unmet_rows_zeroed(t, n, m, max_relative_position, query_offset=query_offset,
                                      is_causal=is_causal) for t in (rel_k, rel_q))
    if rel_bias is not None:  # as a table of one column
        rel_bias = unmet_rows_zeroed(rel_bias[..., None], n, m, max_relative_position, query_offset=query_offset,
                                     is_causal=is_causal)[..., 0]
    # Softmax statistics in at least float32: bf16/fp16 (or autocast) scores are upcast once, here.
    stats = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-1, -2)).to(stats)
    if rel_k is not None:
        reader = q if q_pos is None else q_pos
        rel = (reader @ rel_k.transpose(-1, -2)).to(stats)  # (B, H, N, 2K+1); rel_k is (Hr, 2K+1, D), Hr in {1, H}
        scores = scores + torch.gather(rel, -1, idx.expand(*rel.shape[:-1], m))
    if rel_q is not None:
        by_key = (k @ rel_q.transpose(-1, -2)).to(stats)  # (B, H, M, 2K+1): key j against every table row
        scores = scores + torch.gather(by_key, -1, idx.T.expand(*by_key.shape[:-1], n)).transpose(-1, -2)
    scores = scores * scale
    if rel_bias is not None:  # (Hr, N, M) against (B, H, N, M): the heads broadcast
        scores = scores + rel_bias.to(stats)[:, idx]
    if mask is not None:
        scores = scores + mask.to(stats)
    if is_causal:
        scores = scores.masked_fill(~causal_allowed(n, m, query_offset, q.device), float("-inf"))
    return masked_softmax(scores), idx


def dense_attention(call: AttentionCall, *, need_weights: bool = False):
    """The output (B, H, N, Dv) of ``call`` [and its weights (B, H, N, M) in q's dtype, before dropout]."""
    p, idx = dense_weights(call.q, call.k, call.rel_k, max_relative_position=call.max_relative_position,
                           mask=call.mask, is_causal=call.is_causal, scale=call.scale, query_offset=call.query_offset,
                           rel_q=call.rel_q, q_pos=call.q_pos, rel_bias=call.rel_bias)
    if call.dropout_p > 0.0:  # every backend's mask (_common.dropout_keep), over the whole (B, H, N, M)
        b, h, n, m = p.shape[0], call.q.shape[1], p.shape[-2], p.shape[-1]
        dev = p.device
        p = p * keep_scale(call_seed(call), b, h, torch.arange(n, device=dev), torch.arange(m, device=dev),
                           call.dropout_p, p.dtype)
    v = call.v
    rel_v = unmet_rows_zeroed(call.rel_v, call.q.shape[-2], v.shape[-2], call.max_relative_position,
                              query_offset=call.query_offset, is_causal=call.is_causal)
    out = p.to(v.dtype) @ v
    if rel_v is not None:
        # Bucket sums from the float32 (or float64) weights: a bf16 accumulator over ~M weights loses them.
        buckets = p.new_zeros(*p.shape[:-1], 2 * call.max_relative_position + 1)
        buckets = buckets.scatter_add(-1, idx.expand_as(p), p)
        out = out + buckets.to(rel_v.dtype) @ rel_v
    return (out, p.to(call.q.dtype)) if need_weights else out


BACKEND = Backend("dense", dense_attention, Serves(dropout=True, mask_grad=True, pos_to_content=True,
                                                   position_query=True, rel_bias=True),
                  "(B,H,N,M) scores, key term gathered from q@rel_k.T, value term by bucket sums")
