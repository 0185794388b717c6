"""``patch(model)``: the relative-position self-attention of eole models (``position_encoding_type: Relative``)
computed by :func:`relative_attention`, in training and in cached decoding.

eole (0.6.x) ``SelfMHA`` with ``n_positions = K`` keeps one table per layer, ``relative_positions_embeddings``
(2K + 1, D), shared by the heads and tied: the same rows serve the key term and the value term. Its row is
``clamp(j - i, -K, K) + K``, relattn's own index. Its scores are ``scale * q_i . k_j + q_i . a[idx_ij]`` (the
key term is added to the scaled content scores unscaled), ``scale = attn_scaling ** -0.5`` or ``D ** -0.5``;
relattn scales both terms, so the key table it receives is ``a / scale`` and the value table ``a`` itself: one
parameter, both gradients summed on it by autograd.

Masks are eole's (bool, True = may attend), GQA is eole's (query head ``h`` reads key/value head
``h // (H / Hkv)``), dropout is the module's ``attention_dropout`` in training, ``return_attn`` returns the
(B, H, N, M) weights before dropout as eole does.

Cached decoding: eole's own relative term puts every query of a cached call at the last slot of the key buffer
(``gen_relative_positions(M, cache=True)``), not at its step, so its decodes disagree with its teacher-forced
forward. Patched, the queries of a cached call sit at their steps (``cache_slice``), and only the filled part of
the buffer is read: a cached decode equals the teacher-forced forward of the same tokens. ``positions="eole"``
reproduces eole's cached positions instead (for parity with decodes made by unpatched eole).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import check_name
from ..functional import relative_attention, relative_attention_with_weights
from ._patching import PatchReport, is_patched, swap, unpatch

SUPPORTED = ("eole SelfMHA with position_encoding_type: Relative (encoders, decoders, decoder-only models)",)
POSITIONS = ("step", "eole")

_EOLE_MHA = "eole.modules.multi_headed_attn."


def _eole_positions_call(q, k, v, mask):
    """The tensors of a cached call with eole's positions: every query at the buffer's last slot ``M - 1``. The
    S queries become S batch entries of one query each, (B, S, H, 1, D), reading the same keys (expanded, no
    copy for S = 1); the mask (B, 1, S | 1, M) follows."""
    b, h, s, d = q.shape
    q5 = q.transpose(1, 2).unsqueeze(3)
    k5 = k.unsqueeze(1).expand(b, s, *k.shape[1:])
    v5 = v.unsqueeze(1).expand(b, s, *v.shape[1:])
    m5 = None if mask is None else mask.transpose(1, 2).unsqueeze(2)
    return q5, k5, v5, m5, k.shape[-2] - 1


def _causal_split(mask: torch.Tensor, n: int, offset: int):
    """eole's decoder masks are ``causal & key padding`` written out, (B, 1, N, M): as ``(True, key mask
    (B, 1, 1, M) or None)`` when ``mask`` is exactly that (one O(N M) comparison), so that the kernels skip the
    keys past each query; else ``(False, mask)``."""
    if n == 1 or mask.dim() != 4 or mask.shape[-2] != n or mask.dtype != torch.bool:
        return False, mask
    keys = mask[..., -1:, :]  # the last query may attend every unpadded key
    causal = torch.ones(n, mask.shape[-1], dtype=torch.bool, device=mask.device).tril(offset)
    if not torch.equal(mask, causal & keys):
        return False, mask
    return True, (None if bool(keys.all()) else keys)


def _self_mha_forward(self, query, attn_mask=None, return_attn=False, position_embeddings=None, cache_seqlens=None,
                      cache_slice=None, pos_ids_2d=None):
    """eole's ``SelfMHA.forward`` with the attention on :func:`relative_attention`."""
    cached = self.kcache is not None
    if cached and cache_slice is None:  # eole's flash kv-cache path, which eole never takes with relative positions
        return type(self).forward(self, query, attn_mask=attn_mask, return_attn=return_attn,
                                  position_embeddings=position_embeddings, cache_seqlens=cache_seqlens,
                                  cache_slice=cache_slice, pos_ids_2d=pos_ids_2d)
    key, value, query = self._prepare_inputs(query, query, query, position_embeddings=position_embeddings,
                                             pos_ids_2d=pos_ids_2d)
    if cached:
        key, value, query = self._update_cache_w_inputs(query, key, value, cache_seqlens=cache_seqlens,
                                                        cache_slice=cache_slice)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # eole's (B, L, H, D) as (B, H, L, D)
    m = k.shape[-2]
    mask = attn_mask
    if mask is not None:
        mask = (mask[None, None] if mask.dim() == 2 else mask)[..., :m]
    offset, end = 0, m
    eole_positions = cached and self._relattn_positions == "eole"
    if eole_positions:
        q, k, v, mask, offset = _eole_positions_call(q, k, v, mask)
    elif cached:  # queries at their steps; keys past the last query are masked, so they are not read at all
        offset = int(cache_slice[0])
        end = offset + q.shape[-2]
        k, v = k[..., :end, :], v[..., :end, :]
        mask = None if mask is None else mask[..., :end]
    is_causal = False
    if mask is not None and not eole_positions:
        is_causal, mask = _causal_split(mask, q.shape[-2], offset)
    scale = self.dim_per_head ** -0.5 if self.scale is None else self.scale
    table = self.relative_positions_embeddings.weight
    args = dict(max_relative_position=self.n_positions, attn_mask=mask, is_causal=is_causal, scale=scale,
                query_offset=offset,
                enable_gqa=k.shape[-3] != q.shape[-3],
                dropout_p=float(self.dropout.p) if self.dropout_p > 0 and self.dropout.training else 0.0)
    if return_attn:
        out, weights = relative_attention_with_weights(q, k, v, table / scale, table, **args)
    else:
        out, weights = relative_attention(q, k, v, table / scale, table, backend=self._relattn_backend, **args), None
    if eole_positions:  # (B, S, H, 1, X) -> (B, H, S, X)
        out = out.squeeze(3).transpose(1, 2)
        weights = None if weights is None else weights.squeeze(3).transpose(1, 2)
    elif weights is not None and end < m:  # the unread (masked) slots of the buffer, as eole returns them
        weights = F.pad(weights, (0, m - end))
    context = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
    if self.q_gating and hasattr(self, "_attn_gate"):
        context = context * self._attn_gate
    out = self.final_linear(context) if cached else self.maybe_ckpt(self.final_linear, context)
    return out, weights


def _reason(module) -> str | None:
    """Why an eole attention module is left as it is; None when it is patched."""
    cls = type(module).__name__
    if cls == "ContextMHA":
        return "cross-attention: no relative positions, left as it is"
    if cls != "SelfMHA":
        return f"{cls} is not eole's SelfMHA"
    if getattr(module, "relative_attention_bias", None) is not None:
        return ("relative_positions_buckets > 0 is T5's bucketed scalar bias, not Shaw attention (relattn patches "
                "position_encoding_type: Relative)")
    if getattr(module, "relative_positions_embeddings", None) is None:
        return (f"position_encoding_type={getattr(module, 'position_encoding_type', None)!s}: no Shaw relative "
                "positions (relattn patches position_encoding_type: Relative)")
    if getattr(module, "parallel_gpu", 1) > 1:
        return "tensor parallelism (parallel_gpu > 1) is not supported"
    return None


def _is_eole_attention(module: nn.Module) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" == _EOLE_MHA + "MultiHeadedAttention" for c in type(module).__mro__)


def patch(model: nn.Module, *, backend: str = "auto", positions: str = "step") -> PatchReport:
    """Replace, in place, the forward of every relative-position self-attention (``SelfMHA`` with
    ``position_encoding_type: Relative``) of an eole model with one that calls :func:`relative_attention` on the
    module's own parameters. Classes, parameters and ``state_dict`` do not change.

    Args:
        model: an eole model (``EncoderDecoderModel``, ``DecoderModel``, ``EncoderModel``) or any ``nn.Module``
            holding eole attention modules.
        backend: relattn backend for every patched module (``"auto"`` picks one with dropout when training).
        positions: where the queries of a cached (decoding) call sit. ``"step"``: at their steps, so that a
            cached decode equals the teacher-forced forward. ``"eole"``: every query at the last slot of the key
            buffer, as eole 0.6 computes them (parity with unpatched eole decodes; not what its models were
            trained on). Uncached calls (training, scoring) are the same either way.

    Returns:
        A :class:`PatchReport`: ``patched`` module names and ``skipped`` attention modules with the reason.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    backend = check_name(backend)
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(repr(p) for p in POSITIONS)}; got {positions!r}")
    report = PatchReport()
    for name, module in model.named_modules():
        if not _is_eole_attention(module):
            continue
        reason = _reason(module)
        if reason is not None:
            report.skipped[name] = reason
            continue
        swap(module, _self_mha_forward, backend, positions=positions)
        report.patched.append(name)
    report.warn_if_empty(model, SUPPORTED)
    return report


__all__ = ["POSITIONS", "SUPPORTED", "PatchReport", "is_patched", "patch", "unpatch"]
