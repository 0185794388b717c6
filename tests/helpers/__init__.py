"""What every test layer shares: one input factory, one oracle, one tolerance policy, gradients, and which
backends can run here.

- :func:`random_inputs` draws ``q, k, v, rel_k, rel_v`` for a window (an int ``K`` or a pair ``(left, right)``),
  with the tables named by one word from :data:`TABLES`.
- The oracle. :func:`reference_output` is the specification (``relattn.reference``, numpy, float64) applied to
  torch tensors, taking the op's keywords. :func:`attention_ref` is the same function written the plain
  PyTorch way (the tables gathered into (N, M, D) tensors, as tensor2tensor and Hugging Face compute it):
  with ``upcast=True`` in float64, the truth for gradients (torch autograd through it; its outputs are checked
  against the specification, its gradients against the specification's finite differences); with
  ``upcast=False`` in the inputs' own dtype, the yardstick of what plain PyTorch gets at that precision.
- The tolerance policy, :func:`assert_close` (:func:`error_bound`): float64 and float32 within
  ``TOL_EPS * eps(dtype) * (1 + max|want|)``; a 16-bit result within twice the yardstick's error against the
  same float64 truth, and never asked to beat one rounding (flash-attention's rule).
- :func:`grads` is the output of a backend and its gradients for one output gradient; :func:`oracle_grads` the
  same from the float64 oracle.
- :func:`unavailable_here` / :func:`require_backend`: a backend that cannot run on this machine at all is skipped
  with its reason; anything else a backend refuses, or a native kernel that fails to build, fails the test.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

from relattn import BACKENDS, relative_attention
from relattn import reference as ref
from relattn.backends import AttentionCall, native, not_supported_reasons
from relattn.positions import LogBuckets, T5Buckets, check_window, relative_position_index

TOL_EPS = 512  # float64/float32: max error <= TOL_EPS * eps * (1 + max|want|)
LOW_PRECISION = (torch.float16, torch.bfloat16)  # compared with the plain PyTorch yardstick instead

# Verbatim from the spec's "Testing the implementation" output (Out[14]): the attention weights, rounded.
SPEC_WEIGHTS = """\
[[0.008 0.028 0.001 0.12  0.62  0.223]
 [0.26  0.098 0.35  0.157 0.052 0.083]
 [0.794 0.002 0.077 0.122 0.002 0.002]
 [0.016 0.394 0.025 0.108 0.356 0.101]
 [0.475 0.023 0.002 0.13  0.069 0.301]
 [0.002 0.227 0.001 0.014 0.66  0.097]]"""

# Which tables a test gets: name -> ((rel_k drawn, one per head), (rel_v drawn, one per head)).
TABLES = {
    "shared": ((True, False), (True, False)),
    "per_head": ((True, True), (True, True)),
    "keys_per_head": ((True, True), (True, False)),
    "values_per_head": ((True, False), (True, True)),
    "keys_only": ((True, False), (False, False)),
    "keys_only_per_head": ((True, True), (False, False)),
    "values_only": ((False, False), (True, False)),
    "values_only_per_head": ((False, False), (True, True)),
    "none": ((False, False), (False, False)),
}


def random_inputs(b, h, n, m, d, dv, window, *, tables="shared", dtype=torch.float64, seed=0, requires_grad=False):
    """q (B,H,N,D), k (B,H,M,D), v (B,H,M,Dv) and the tables named by ``tables`` (see :data:`TABLES`):
    (R, D|Dv) shared or (H, R, D|Dv) per head, R = left + right + 1 rows for ``window`` (an int K: 2K + 1).

    Drawn in float64 from one seeded generator in the order q, k, v, rel_k, rel_v, then cast to ``dtype``: the
    same seed gives the same values at every dtype.
    """
    if tables not in TABLES:
        raise ValueError(f"tables must be one of {sorted(TABLES)}; got {tables!r}")
    left, right = check_window(window)
    rows = left + right + 1
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    q, key, v = rnd(b, h, n, d), rnd(b, h, m, d), rnd(b, h, m, dv)
    (has_k, k_heads), (has_v, v_heads) = TABLES[tables]
    rel_k = rnd(*((h,) if k_heads else ()), rows, d) if has_k else None
    rel_v = rnd(*((h,) if v_heads else ()), rows, dv) if has_v else None
    return q, key, v, rel_k, rel_v


def random_mask(kind, shape, seed):
    """A mask of ``shape``: ``"bool"`` (True = may attend, about 70% True), ``"float"`` (standard normal, added to
    the scores) or None for ``kind=None``; seeded."""
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "bool":
        return torch.rand(shape, generator=g) > 0.3
    if kind == "float":
        return torch.randn(shape, generator=g, dtype=torch.float64)
    return None


def np64(t):
    """A tensor as a float64 numpy array (a bool tensor stays bool), None as None."""
    if t is None:
        return None
    t = t.detach().cpu()
    return t.numpy() if t.dtype == torch.bool else t.to(torch.float64).numpy()


def reference_output(q, k, v, rel_k=None, rel_v=None, **op_kwargs):
    """The numpy reference's (B, H, N, Dv) float64 output for the op's inputs and keywords
    (``max_relative_position``, ``beyond``, ``attn_mask``, ``is_causal``, ``scale``, ``query_offset``, ``rel_q``,
    ``content_bias``, ``position_bias``); grouped k/v heads are repeated to q's (the specification has no groups)."""
    op_kwargs = {name: np64(t) if isinstance(t, torch.Tensor) else t for name, t in op_kwargs.items()}
    op_kwargs.pop("enable_gqa", None)
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = ref.relative_attention(np64(q), np64(k), np64(v), np64(rel_k), np64(rel_v), **op_kwargs)
    return torch.from_numpy(np.ascontiguousarray(out))


def _materialised(table, idx, heads, beyond):
    """A (R, D) or (Hr, R, D) table gathered at the (N, M) index: (N, M, D) or (H, N, M, D); beyond="zero"
    indexes one zero row past the last."""
    if beyond == "zero":
        table = torch.cat([table, table.new_zeros(*table.shape[:-2], 1, table.shape[-1])], dim=-2)
    pairs = table[..., idx, :]
    return (pairs.expand(heads, *pairs.shape[1:]), "hnmd") if pairs.dim() == 4 else (pairs, "nmd")


def attention_ref(q, k, v, rel_k=None, rel_v=None, *, max_relative_position, rel_q=None, content_bias=None,
                  position_bias=None, rel_bias=None, attn_mask=None, is_causal=False, scale=None, query_offset=0,
                  beyond="clip", enable_gqa=None, upcast=True):
    """Shaw attention the plain PyTorch way: q (B,H,N,D), k (B,Hkv,M,D), v (B,Hkv,M,Dv) (H % Hkv == 0), tables
    (R, D|Dv) or (Hr, R, D|Dv) (``rel_q``, position-to-content, as ``rel_k``), Transformer-XL's biases (H, D)
    (``content_bias`` on the content term, ``position_bias`` on the key-table term), the op's keywords; returns
    (B, H, N, Dv), differentiable. A :class:`relattn.positions.LogBuckets` (or ``T5Buckets``)
    ``max_relative_position`` indexes the compact tables by its ``row`` of each offset. ``rel_bias`` (R,) or (H, R):
    the scalar bias, added unscaled at the same row (zero beyond a zero-beyond window).

    ``upcast=True``: computed in float64 (the oracle); ``upcast=False``: on the inputs as they are, every matmul
    and the softmax run as a user's own PyTorch code would run them, under autocast too (the yardstick). A row
    with no key it may attend to gives zeros and zero gradients, as in the specification; a NaN reaches what it
    reaches there (the float64 oracle sums the value term by buckets of offsets, as the specification does).
    """
    if upcast:
        q, k, v, rel_k, rel_v, rel_q, content_bias, position_bias, rel_bias = (
            None if t is None else t.double() for t in (q, k, v, rel_k, rel_v, rel_q, content_bias, position_bias,
                                                        rel_bias))
    b, h, n, d = q.shape
    m = k.shape[-2]
    if k.shape[1] != h:  # grouped-query attention: query head i reads key/value head i // (H // Hkv)
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    if isinstance(max_relative_position, (LogBuckets, T5Buckets)):
        offsets = torch.arange(m, device=q.device)[None, :] - torch.arange(n, device=q.device)[:, None] - query_offset
        idx = max_relative_position.row(offsets)
    else:
        idx = relative_position_index(n, m, max_relative_position, query_offset=query_offset, beyond=beyond,
                                      device=q.device)
    q_content = q if content_bias is None else q + content_bias[:, None, :]
    q_pos = q if position_bias is None else q + position_bias[:, None, :]
    scores = q_content @ k.transpose(-1, -2)
    if rel_k is not None:
        ak, letters = _materialised(rel_k, idx, h, beyond)
        scores = scores + torch.einsum(f"bhnd,{letters}->bhnm", q_pos, ak)
    if rel_q is not None:
        aq, letters = _materialised(rel_q, idx, h, beyond)
        scores = scores + torch.einsum(f"bhmd,{letters}->bhnm", k, aq)
    scores = scores * (1 / math.sqrt(d) if scale is None else scale)
    if rel_bias is not None:
        bias = rel_bias if beyond == "clip" else torch.cat([rel_bias, rel_bias.new_zeros(*rel_bias.shape[:-1], 1)], -1)
        scores = scores + bias[..., idx]
    if attn_mask is not None:
        mask = attn_mask.to(q.device)
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=scores.dtype, device=q.device).masked_fill(~mask, -math.inf)
        scores = scores + mask.to(scores.dtype)
    if is_causal:
        future = torch.arange(m, device=q.device)[None, :] > torch.arange(n, device=q.device)[:, None] + query_offset
        scores = scores.masked_fill(future, -math.inf)
    empty = (scores == -math.inf).all(-1, keepdim=True)  # no key allowed (or M = 0): zeros, zero gradients
    w = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = w @ v
    if rel_v is not None and upcast:
        # the specification's value term: per-row bucket sums of the weights times the table, so a NaN entry
        # reaches every row (0 * NaN), as there (where a row no allowed pair meets is zeroed first: not here)
        rows = rel_v.shape[-2] + (beyond == "zero")
        buckets = w.new_zeros(*w.shape[:-1], rows).scatter_add(-1, idx.expand_as(w), w)
        table = rel_v if beyond == "clip" else torch.cat([rel_v, rel_v.new_zeros(*rel_v.shape[:-2], 1,
                                                                                  rel_v.shape[-1])], dim=-2)
        out = out + buckets @ table
    elif rel_v is not None:
        av, letters = _materialised(rel_v, idx, h, beyond)
        out = out + torch.einsum(f"bhnm,{letters}->bhnd", w, av)
    return out


def plain_module_forward(mod, x, *, is_causal=False):
    """Self-attention of a ``RelativeMultiheadAttention`` ``mod`` on ``x`` (B, N, E) -> (B, N, E), written the
    plain PyTorch way: its own projections and parameters, the attention by :func:`attention_ref` with
    ``upcast=False`` (the tables gathered into (N, N, D) tensors). The yardstick for the module and the LM."""
    b, n, _ = x.shape
    q, k, v = (proj(x).unflatten(-1, (mod.num_heads, mod.head_dim)).transpose(1, 2)
               for proj in (mod.q_proj, mod.k_proj, mod.v_proj))
    out = attention_ref(q, k, v, mod.rel_k, mod.rel_v, max_relative_position=mod.positions.max_relative_position,
                        beyond=mod.positions.beyond, is_causal=is_causal, upcast=False)
    return mod.out_proj(out.transpose(1, 2).reshape(b, n, mod.embed_dim))


# The op's tensor keywords that get gradients too (after the inputs, in this order) when given
GRAD_KEYWORDS = ("rel_q", "content_bias", "position_bias", "rel_bias")


def oracle_grads(inputs, go, **op_kwargs):
    """:func:`grads` from the float64 oracle (:func:`attention_ref`): the output and the gradients of
    ``(out * go).sum()`` for the inputs that are not None, in order, then for the keywords of
    :data:`GRAD_KEYWORDS` that are given, all float64."""
    x = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    op_kwargs = {k: v for k, v in op_kwargs.items() if k != "dropout_p"}
    extra = [op_kwargs[name].detach().double().requires_grad_() for name in GRAD_KEYWORDS
             if op_kwargs.get(name) is not None]
    op_kwargs.update((name, t) for name, t in zip([n for n in GRAD_KEYWORDS if op_kwargs.get(n) is not None], extra,
                                                  strict=True))
    out = attention_ref(*x, **op_kwargs)
    present = [t for t in x if t is not None] + extra
    return out.detach(), torch.autograd.grad(out, present, go.double(), allow_unused=True)


def tol(dtype: torch.dtype) -> float:
    return TOL_EPS * torch.finfo(dtype).eps


def max_error(got, want) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return (got - want).abs().max().item() if got.numel() else 0.0


def error_bound(want, dtype, *, yardstick=None) -> float:
    """The most error the policy allows a ``dtype`` result against the float64 truth ``want``:
    ``TOL_EPS * eps * (1 + max|want|)`` for float64/float32; for 16-bit dtypes twice the error of ``yardstick``
    (plain PyTorch's result at that dtype, :func:`attention_ref` with ``upcast=False``) against ``want``, and at
    least twice one rounding, ``eps / 2 * max|want|``, the least error any result in that dtype can have."""
    peak = want.detach().abs().max().item() if want.numel() else 0.0
    if dtype in LOW_PRECISION:
        if yardstick is None:
            raise ValueError(f"a {dtype} result is compared with plain PyTorch's: pass yardstick=")
        return 2 * max(max_error(yardstick, want), torch.finfo(dtype).eps / 2 * peak)
    return tol(dtype) * (1.0 + peak)


def assert_close(got, want, dtype, what="", *, yardstick=None):
    """The one tolerance policy: ``got`` (computed at ``dtype``) against ``want`` (float64 truth), within
    :func:`error_bound`; shapes must match. Where ``want`` is NaN, ``got`` must be NaN too."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    nan = want.isnan()
    if nan.any():
        assert torch.equal(got.isnan(), nan), f"{what}: NaN at {got.isnan().nonzero().tolist()}, " \
                                              f"want {nan.nonzero().tolist()}"
        got, want = got[~nan], want[~nan]
        yardstick = None if yardstick is None else yardstick.detach().cpu().double()[~nan]
    err, bound = max_error(got, want), error_bound(want, dtype, yardstick=yardstick)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"



def grads_close(got: dict, want: dict, dtype, what=""):
    """Named gradients (a model's parameters) against the unpatched model's, each within the policy
    (:func:`assert_close`); one that is zero in exact arithmetic (a key bias under the softmax, a conv bias before
    a train-mode BatchNorm) is rounding noise in both, held to the policy's bound on the largest gradient."""
    peak = max(w.detach().abs().max().item() for w in want.values())
    for name, w in want.items():
        if w.abs().max() <= torch.finfo(dtype).eps ** 0.5 * peak:
            err = (got[name].detach().double() - w.detach().double()).abs().max().item()
            assert err <= TOL_EPS * torch.finfo(dtype).eps * (1 + peak), f"{what} {name}: max error {err:.3g}"
        else:
            assert_close(got[name], w, dtype, f"{what} {name}")


def per_sequence(one, cu_seqlens_q, cu_seqlens_k, q, k, v, *, query_rows=None, query_offset=0, **shared):
    """The oracle of a packed (varlen) call: each sequence by itself, ``one(q_s, k_s, v_s, query_offset=m_s - n_s +
    query_offset, **shared)`` on its rows as (1, H, n_s, D) views of the packed (T, H, D) tensors (``query_rows``:
    more (T, ...) tensors sliced by query rows, such as ``q_pos``, passed by name), the outputs packed back into
    (T, H, Dv). Differentiable: gradients reach the packed inputs through the slices, a shared table's summed over
    the sequences. ``one`` is ``attention_ref`` (the float64 truth or plain PyTorch's yardstick) or a backend's
    dense call."""
    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have as many entries; got {len(cq)} and {len(ck)}")

    def rows(t, a, b):
        return t[a:b].transpose(0, 1).unsqueeze(0)

    outs = []
    for s in range(len(cq) - 1):
        (a, b), (c, e) = cq[s:s + 2], ck[s:s + 2]
        more = {name: None if t is None else rows(t, a, b) for name, t in (query_rows or {}).items()}
        out = one(rows(q, a, b), rows(k, c, e), rows(v, c, e), query_offset=(e - c) - (b - a) + query_offset,
                  **more, **shared)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)

def grads(backend, inputs, go, **op_kwargs):
    """The op's output on ``inputs = (q, k, v, rel_k, rel_v)`` and the gradients of ``(out * go).sum()`` for the
    inputs that are not None, in order, then for the keywords of :data:`GRAD_KEYWORDS` that are given."""
    present = [t for t in inputs if t is not None] + [op_kwargs[n] for n in GRAD_KEYWORDS
                                                      if op_kwargs.get(n) is not None]
    out = relative_attention(*inputs, backend=backend, **op_kwargs)
    return out, torch.autograd.grad(out, present, go, allow_unused=True)


# ------------------------------------------------------------------------------------ shared cases

# The shapes every fast backend is tested on: (b, h, n, m, d, dv, K, tables, is_causal, query_offset)
CASES = [
    (2, 3, 9, 9, 5, 5, 3, "keys_per_head", False, 0),
    (2, 3, 9, 9, 5, 5, 3, "values_per_head", True, 0),
    (1, 2, 7, 12, 6, 4, 2, "per_head", True, 5),  # decoding: N != M, offset M - N
    (1, 2, 12, 7, 4, 6, 2, "keys_only_per_head", False, -3),
    (1, 2, 10, 10, 4, 4, 4, "values_only", True, 0),
    (2, 1, 8, 8, 3, 3, 2, "none", False, 0),
    (1, 2, 5, 5, 4, 4, 9, "per_head", False, 0),  # K >= N
    (1, 2, 6, 6, 4, 4, 0, "keys_per_head", True, 0),  # K = 0
    (1, 1, 1, 1, 3, 3, 2, "shared", False, 0),  # N = 1
    (1, 2, 97, 97, 59, 59, 8, "keys_per_head", False, 0),  # awkward N, D
    (1, 2, 97, 97, 59, 59, 8, "values_per_head", True, 0),
    (1, 2, 7, 30, 5, 5, 3, "per_head", True, 23),
]
IDS = [f"n{c[2]}m{c[3]}d{c[4]}K{c[6]}-{c[7]}-{'causal' if c[8] else 'full'}-off{c[9]}" for c in CASES]


def case_inputs(case, **kw):
    """A CASES entry's inputs (``kw`` to :func:`random_inputs`) and its op keywords."""
    b, h, n, m, d, dv, kk, tables, causal, off = case
    return random_inputs(b, h, n, m, d, dv, kk, tables=tables, **kw), dict(max_relative_position=kk,
                                                                            is_causal=causal, query_offset=off)


# ------------------------------------------------------------------------------------ which backends run here


def _plain_call() -> AttentionCall:
    x = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    return AttentionCall(x, x, x, None, None, 1, None, False, 0.0, 1.0, 0)


def unavailable_here(name: str) -> str | None:
    """Why backend ``name`` cannot run in this test session at all, else None ("auto" always can).

    Unavailable: a backend that does not serve plain float64 CPU inputs by its declaration (a GPU kernel), or
    whose ``unavailable()`` says so (a missing package). For "native" only a missing C++ compiler or
    ``RELATTN_NATIVE=0`` count: a build that starts and fails is a bug, so its tests run and fail.
    """
    if name == "auto":
        return None
    backend = BACKENDS[name]
    declared = not_supported_reasons(dataclasses.replace(backend, unavailable=lambda: None), _plain_call())
    if declared:
        return f"backend {name!r} does not serve float64 CPU inputs: {'; '.join(declared)}"
    if name == "native":
        if os.environ.get("RELATTN_NATIVE", "1") == "0":
            return "native kernel: disabled by RELATTN_NATIVE=0"
        missing = native.toolchain_missing()
        return None if missing is None else f"native kernel: {missing}"
    why = backend.unavailable()
    return None if why is None else f"backend {name!r}: {why}"


def require_backend(name: str) -> None:
    """Skip the calling test, with the reason, when backend ``name`` cannot run here at all (see
    :func:`unavailable_here`). A backend that can must then serve the test's inputs: a refusal fails the test."""
    if (why := unavailable_here(name)) is not None:
        pytest.skip(f"unavailable here: {why}")


def backend_params(names) -> list:
    """``names`` as pytest params, each unavailable one marked skip with its reason (checked at collection), and
    "triton" under Triton's interpreter (no CUDA: about a second a call) marked slow."""
    return [pytest.param(n, marks=[pytest.mark.skipif(why is not None, reason=str(why)),
                                   *([pytest.mark.slow] if n == "triton" and not torch.cuda.is_available() else [])])
            for n in names for why in [unavailable_here(n)]]

