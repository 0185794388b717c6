"""What the DeBERTa v1 and v2/v3 tests share: the tolerances of a patched model's outputs, the sequence length and
its padded inputs, and the head-class check (logits at the real tokens and every parameter's gradient)."""

from __future__ import annotations

import torch

from helpers import grads_close
from helpers.hf import relative_error

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
N = 23


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (2, N), generator=g)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[1, 15:] = 0
    return ids, mask


def assert_head_outputs_match(plain, patched):
    """A head model's logits at the real tokens, and every parameter's gradient of a loss on them, patched against
    unpatched (float64, 1e-10)."""
    ids, mask = inputs()
    outs = []
    for model in (plain, patched):
        out = model(input_ids=ids, attention_mask=mask)
        logits = out.logits if hasattr(out, "logits") else torch.stack([out.start_logits, out.end_logits], -1)
        real = logits[mask.bool()] if logits.dim() > 2 and logits.shape[1] == N else logits
        model.zero_grad(set_to_none=True)
        (real * torch.linspace(-1, 1, real.shape[-1], dtype=real.dtype)).sum().backward()
        outs.append((real, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_g), (got, got_g) = outs
    assert relative_error(got, want) <= 1e-10
    assert set(got_g) == set(want_g)
    grads_close(got_g, want_g, torch.float64)
