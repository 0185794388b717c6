"""Bad calls and the errors they must raise, shared by the validation tests and the plan tests (a bad call raises
what it always raised, planned or not): :func:`base` is a valid call's tensors, ``CASES`` tensors that make it bad,
``KW_CASES`` keywords that make it bad, each with the exception and the message it must match."""

import torch


def base(**over):
    t = dict(q=torch.randn(2, 3, 5, 4), k=torch.randn(2, 3, 6, 4), v=torch.randn(2, 3, 6, 7),
             rel_k=torch.randn(5, 4), rel_v=torch.randn(5, 7))
    t.update(over)
    return t


CASES = [
    (dict(q=torch.randn(4)), ValueError, r"q must be \(\.\.\., L, D\), at least 2-D; got 1 dims \(4\)"),
    (dict(q=torch.randn(3, 5, 4)), ValueError, r"k must be \(\.\.\., H, M, D\) = \(3, M, 4\) to match q \(3, 5, 4\); "
                                               r"got \(2, 3, 6, 4\)"),
    (dict(k=torch.randn(2, 3, 6, 5)), ValueError, r"k must be \(B, H, M, D\) = \(2, 3, M, 4\).*got \(2, 3, 6, 5\)"),
    (dict(k=torch.randn(2, 2, 6, 4)), ValueError, r"k must be .*got \(2, 2, 6, 4\)"),
    (dict(v=torch.randn(2, 3, 5, 7)), ValueError, r"v must be \(B, H, M, Dv\) = \(2, 3, 6, Dv\).*got \(2, 3, 5, 7\)"),
    (dict(rel_k=torch.randn(7, 4)), ValueError, r"rel_k must be \(5, 4\) or \(3, 5, 4\).*got \(7, 4\)"),
    (dict(rel_k=torch.randn(5, 3)), ValueError, r"rel_k must be \(5, 4\).*got \(5, 3\)"),
    (dict(rel_k=torch.randn(2, 5, 4)), ValueError, r"rel_k .*H=3.*got \(2, 5, 4\)"),
    (dict(rel_v=torch.randn(5, 4)), ValueError, r"rel_v must be \(5, 7\).*got \(5, 4\)"),
    (dict(rel_v=torch.randn(1, 1, 5, 7)), ValueError, r"rel_v must be .*got 4 dims"),
    (dict(k=torch.randn(2, 3, 6, 4, dtype=torch.float64)), TypeError, r"k has dtype torch.float64 but q has dtype"),
    (dict(rel_v=torch.randn(5, 7, dtype=torch.float16)), TypeError, r"rel_v has dtype torch.float16"),
    (dict(v=torch.randn(2, 3, 6, 7, device="meta")), ValueError, r"v is on meta but q is on cpu"),
    (dict(q=torch.ones(2, 3, 5, 4, dtype=torch.long)), TypeError, r"q must be floating point"),
    (dict(q=[1, 2]), TypeError, r"q must be a Tensor, got list"),
]


KW_CASES = [
    (dict(max_relative_position=-1), ValueError, r"max_relative_position must be >= 0, got -1"),
    (dict(max_relative_position=2.0), TypeError, r"max_relative_position must be an int"),
    (dict(attn_mask=torch.ones(5, 6, dtype=torch.int32)), TypeError, r"attn_mask must be bool .*got torch.int32"),
    (dict(attn_mask=torch.ones(6, 6, dtype=torch.bool)), ValueError,
     r"attn_mask of shape \(6, 6\) does not broadcast to \(B, H, N, M\) = \(2, 3, 5, 6\)"),
    (dict(attn_mask=torch.ones(2, 2, 5, 6)), ValueError, r"attn_mask of shape \(2, 2, 5, 6\) does not broadcast"),
    (dict(attn_mask=torch.ones(1, 2, 3, 5, 6)), ValueError, r"attn_mask of shape \(1, 2, 3, 5, 6\)"),
    (dict(attn_mask=[[True]]), TypeError, r"attn_mask must be a Tensor"),
    (dict(backend="fast"), ValueError, r"backend must be one of 'auto', 'dense'.*got 'fast'"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\), got 1.0"),
    (dict(is_causal=1), TypeError, r"is_causal must be a bool"),
    (dict(query_offset=1.0), TypeError, r"query_offset must be an int"),
    (dict(scale="x"), TypeError, r"scale must be a float"),
    # windows (left, right) and what lies beyond them
    (dict(max_relative_position=(1, -1)), ValueError, r"max_relative_position's right must be an int >= 0; got -1"),
    (dict(max_relative_position=(True, 3)), ValueError, r"max_relative_position's left must be an int >= 0; got True"),
    (dict(max_relative_position=(2,)), ValueError,
     r"max_relative_position as a pair must be \(left, right\); got \(2,\)"),
    (dict(max_relative_position=[1, 2, 1]), ValueError, r"max_relative_position as a pair must be \(left, right\)"),
    (dict(max_relative_position="2"), TypeError, r"max_relative_position must be an int, got str"),
    (dict(beyond="edge"), ValueError, r"beyond must be one of \('clip', 'zero'\); got 'edge'"),
    (dict(beyond=None), ValueError, r"beyond must be one of \('clip', 'zero'\); got None"),
    # the tables have 5 rows: right for K = 2 and for (3, 1), wrong for (2, 1) and (4, 1)
    (dict(max_relative_position=(2, 1)), ValueError,
     r"rel_k must be \(4, 4\) or \(3, 4, 4\) for H=3, 4 table rows, head dim 4; got \(5, 4\)"),
    (dict(max_relative_position=(4, 1), beyond="zero"), ValueError, r"rel_k must be \(6, 4\) .*got \(5, 4\)"),
    # Transformer-XL's biases: (H, D), one row per query head, q's dtype and device
    (dict(content_bias=torch.randn(4)), ValueError, r"content_bias must be \(H, D\) = \(3, 4\), one row per query "
                                                    r"head; got \(4\)"),
    (dict(position_bias=torch.randn(1, 4)), ValueError, r"position_bias must be \(H, D\) = \(3, 4\).*got \(1, 4\)"),
    (dict(position_bias=torch.randn(3, 4, dtype=torch.float64)), TypeError, r"position_bias has dtype torch.float64"),
    (dict(content_bias=[0.0] * 4), TypeError, r"content_bias must be a Tensor or None, got list"),
]

