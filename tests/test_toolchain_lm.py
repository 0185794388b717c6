"""TransformerLM inside the PyTorch toolchain: a compiled training step, torch.export, autocast, determinism.

Same conventions as ``test_toolchain.py``: every backend in ``relattn.BACKENDS`` plus "auto", read at
collection time; a backend that refuses the CPU inputs is skipped with its reason.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import relattn
import relattn.model as model_lib
from _plain_attention import plain_shaw_forward

NAMES = ["auto", *relattn.BACKENDS]
F32_TOL = {"rtol": 64 * torch.finfo(torch.float32).eps, "atol": 64 * torch.finfo(torch.float32).eps}
BF16_EPS = torch.finfo(torch.bfloat16).eps
VOCAB = 37


def _lm(backend: str, *, seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    sizes = dict(vocab_size=VOCAB, d_model=24, n_heads=3, n_layers=2, d_ff=48, max_relative_position=3,
                 share_heads=False, backend=backend)
    sizes.update(overrides)
    return model_lib.TransformerLM(model_lib.TransformerConfig(**sizes))


def _refusal(name: str, model: nn.Module, tokens: torch.Tensor, dtype=torch.float32) -> str | None:
    """Why backend ``name`` cannot serve the causal attention calls of ``model`` on ``tokens``."""
    if name == "auto":
        return None
    attn = next(m for m in model.modules() if isinstance(m, relattn.RelativeMultiheadAttention))
    b, n = tokens.shape
    q = torch.zeros(b, attn.num_heads, n, attn.head_dim, dtype=dtype)
    tables = [None if t is None else t.detach().to(dtype) for t in (attn.rel_k, attn.rel_v)]
    call = relattn.functional.validate(q, q, q, *tables, max_relative_position=attn.max_relative_position,
                                       attn_mask=None, is_causal=True, dropout_p=0.0, scale=None, query_offset=0)
    return "; ".join(relattn.backends.not_supported_reasons(relattn.BACKENDS[name], call)) or None


def _tokens(b: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# A compiled training step (fullgraph) equals the eager one: loss and every gradient
# ----------------------------------------------------------------------------------------------------------------

class _Step(nn.Module):
    """One LM per backend; forward returns the summed next-token losses, the thing a training step differentiates."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        base = _lm("auto")
        self.lms = nn.ModuleList()
        for name in names:
            lm = copy.deepcopy(base)
            for m in lm.modules():
                if isinstance(m, relattn.RelativeMultiheadAttention):
                    m.backend = name
            self.lms.append(lm)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.stack([lm.loss(tokens, targets) for lm in self.lms])


def test_compiled_training_step_matches_eager():
    tokens, targets = _tokens(2, 17, 1), _tokens(2, 17, 2)
    probe = _lm("auto")
    names = [n for n in NAMES if _refusal(n, probe, tokens) is None]
    assert "auto" in names
    step = _Step(names)

    def run(fn):
        step.zero_grad(set_to_none=True)
        losses = fn(tokens, targets)
        losses.sum().backward()
        return losses.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in step.named_parameters()}

    loss_e, grads_e = run(step)
    torch._dynamo.reset()
    # aot_eager: dynamo (graph breaks, fullgraph) and AOTAutograd (fake tensors, the registered autograd
    # formulas) exactly as inductor sees them, without the C++ build: that costs ~1 min per LM graph on 2 cores,
    # and inductor's code generation around the attention op is covered by test_toolchain.py.
    loss_c, grads_c = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    # same weights in every backend's copy, so the same loss: a backend computing something else shows here
    torch.testing.assert_close(loss_e, loss_e[:1].expand_as(loss_e), **F32_TOL)
    assert 0 < loss_e[0] < 2 * torch.log(torch.tensor(float(VOCAB)))
    torch.testing.assert_close(loss_c, loss_e, **F32_TOL)
    assert any("rel_k" in k for k in grads_e) and any("rel_v" in k for k in grads_e)
    for key, g in grads_e.items():
        torch.testing.assert_close(grads_c[key], g, **F32_TOL, msg=lambda m, k=key: f"{k}: {m}")


# ----------------------------------------------------------------------------------------------------------------
# torch.export of the forward with a dynamic sequence length
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_export_lm_dynamic_length_matches_eager(name):
    lm = _lm(name).eval()
    for n in (9, 6, 45):
        reason = _refusal(name, lm, _tokens(2, n, 0))
        if reason is not None:
            pytest.skip(f"backend {name!r} cannot serve N={n}: {reason}")
    seq = torch.export.Dim("seq", min=2, max=4096)
    ep = torch.export.export(lm, (_tokens(2, 9, 3),), dynamic_shapes={"tokens": {1: seq}})
    for n in (6, 45):
        tokens = _tokens(2, n, n)
        got = ep.module()(tokens)
        assert got.shape == (2, n, VOCAB)
        torch.testing.assert_close(got, lm(tokens), **F32_TOL)


# ----------------------------------------------------------------------------------------------------------------
# Mixed precision: the LM under bf16 autocast, within 2x of the same LM with plain PyTorch attention
# ----------------------------------------------------------------------------------------------------------------

def _with_plain_attention(lm: nn.Module) -> nn.Module:
    """A copy of ``lm`` whose attention layers compute the same function the plain (materialised) way."""
    lm = copy.deepcopy(lm)
    for m in lm.modules():
        if isinstance(m, relattn.RelativeMultiheadAttention):
            def forward(self, query, key=None, value=None, *, is_causal=False, **unused):
                assert key is None and value is None and all(v is None for v in unused.values())
                return plain_shaw_forward(self, query, is_causal=is_causal), None
            m.forward = types.MethodType(forward, m)
    return lm


def _lm_errors(lm, tokens, targets):
    lm64 = copy.deepcopy(lm).double()
    ref = lm64(tokens)
    torch.nn.functional.cross_entropy(ref.flatten(0, 1), targets.flatten()).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = lm(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    grads64 = dict(lm64.named_parameters())
    errors = {"logits": (logits.double() - ref).abs().max().item()}
    for n, p in lm.named_parameters():
        errors[n] = (p.grad.double() - grads64[n].grad).abs().max().item()
    return errors, ref.detach(), {n: p.grad for n, p in grads64.items()}


@pytest.mark.parametrize("name", NAMES)
def test_autocast_lm_within_twice_plain_pytorch(name):
    lm = _lm(name, seed=4, d_model=64, n_heads=4, max_relative_position=4)
    tokens, targets = _tokens(2, 97, 5), _tokens(2, 97, 6)
    reason = _refusal(name, lm, tokens, dtype=torch.bfloat16)
    if reason is not None:
        pytest.skip(f"backend {name!r} cannot serve bf16 inputs: {reason}")
    ours, ref, grads64 = _lm_errors(lm, tokens, targets)
    plain, plain_ref, _ = _lm_errors(_with_plain_attention(lm), tokens, targets)
    torch.testing.assert_close(plain_ref, ref, rtol=1e-10, atol=1e-10)  # the yardstick is the same function
    assert ours["logits"] > 0
    for key in ["logits", *(k for k in ours if "embed" in k or ".rel_" in k)]:
        bound = 2 * plain[key]
        if ".rel_" in key:
            # bf16 table gradients: one rounding, u * |grad|, is the floor (see test_toolchain.py)
            bound = max(bound, 2 * (BF16_EPS / 2) * grads64[key].abs().max().item())
        assert ours[key] <= bound, f"{key}: bf16 error {ours[key]:.3g} > {bound:.3g} (plain: {plain[key]:.3g})"


# ----------------------------------------------------------------------------------------------------------------
# Determinism: two backward passes of the LM give bitwise identical gradients
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_lm_backward_is_bitwise_deterministic(name):
    lm = _lm(name, seed=7)
    tokens, targets = _tokens(3, 120, 8), _tokens(3, 120, 9)
    reason = _refusal(name, lm, tokens)
    if reason is not None:
        pytest.skip(f"backend {name!r} cannot serve this CPU input: {reason}")
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            lm.zero_grad(set_to_none=True)
            lm.loss(tokens, targets).backward()
            runs.append({n: p.grad.clone() for n, p in lm.named_parameters()})
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    assert any(".rel_k" in n for n in runs[0]) and any(".rel_v" in n for n in runs[0])
    for n, g in runs[0].items():
        assert torch.equal(g, runs[1][n]), f"{n}: gradients differ between two identical backward passes"
