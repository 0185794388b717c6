"""relattn.integrations.eole.patch on small eole 0.6.4 models built in Python: the patched model's outputs,
attention weights and every gradient equal eole's own (float64 with eole's float32 cast of the scores removed;
float32 as eole runs), and a cached decode equals the teacher-forced forward of the same tokens, which eole's own
cached decoding does not (its offset bug, reproduced by ``positions="eole"``).

eole is installed without its dependencies (``pip install --no-deps eole==0.6.4``, with the ``eole`` extra);
CI sets ``RELATTN_REQUIRE_EOLE=1`` so that these tests fail instead of skipping when it is missing."""

from __future__ import annotations

import contextlib
import inspect
import os
import textwrap
import warnings

import pytest
import torch

if os.environ.get("RELATTN_REQUIRE_EOLE"):
    import eole  # noqa: F401
else:
    pytest.importorskip("eole", reason="eole is not installed (pip install --no-deps eole==0.6.4)")

with warnings.catch_warnings():  # eole warns that its C++ and flash-attention extensions are missing
    warnings.simplefilter("ignore", RuntimeWarning)
    import eole.modules.multi_headed_attn as mha
    from eole.config.inference import InferenceConfig
    from eole.config.models import TransformerLMModelConfig, TransformerModelConfig
    from eole.models.model import DecoderModel, EncoderDecoderModel

from helpers import assert_close  # noqa: E402
from relattn.integrations.eole import is_patched, patch, unpatch  # noqa: E402

V = 23
PAD = V - 1


class _Vocab(dict):
    pass


_VOCAB = _Vocab({f"t{i}": i for i in range(V - 1)}, **{"<blank>": PAD})
VOCABS = {"specials": {"pad_token": "<blank>"}, "src": _VOCAB, "tgt": _VOCAB}


@contextlib.contextmanager
def no_float32_cast():
    """eole's own attention (``MultiHeadedAttention._compute_attention``, its source as installed) with its float32
    cast of the scores and the softmax removed, so that a float64 model is computed in float64 throughout."""
    source = textwrap.dedent(inspect.getsource(mha.MultiHeadedAttention._compute_attention))
    for old, new in (("scores = scores.float()", "pass"), ("dtype=torch.float32", "dtype=scores.dtype")):
        assert source.count(old) == 1, f"eole's attention changed: {old!r}"
        source = source.replace(old, new)
    namespace = {}
    exec(compile(source, mha.__file__, "exec"), vars(mha), namespace)
    original = mha.MultiHeadedAttention._compute_attention
    mha.MultiHeadedAttention._compute_attention = namespace["_compute_attention"]
    try:
        yield
    finally:
        mha.MultiHeadedAttention._compute_attention = original


def _init(model, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # eole builds its linears with skip_init: give every parameter a value
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.to(dtype)


def encoder_decoder(dtype=torch.float64, *, n_positions=3, heads_kv=2, attn_scaling=None, running=None, **kw):
    cfg = TransformerModelConfig(hidden_size=32, heads=4, heads_kv=heads_kv, transformer_ff=40, layers=2,
                                 attn_scaling=attn_scaling, max_position_embeddings=24, **kw,
                                 embeddings={"word_vec_size": 32, "position_encoding_type": "Relative",
                                             "n_positions": n_positions})
    return _init(EncoderDecoderModel.build_blocks(cfg, VOCABS, running_config=running), dtype).eval()


def decoder_only(dtype=torch.float64, *, n_positions=4, running=None, **kw):
    cfg = TransformerLMModelConfig(hidden_size=24, heads=3, transformer_ff=40, layers=2, max_position_embeddings=24,
                                   **kw, embeddings={"word_vec_size": 24, "position_encoding_type": "Relative",
                                                     "n_positions": n_positions})
    return _init(DecoderModel.build_blocks(cfg, VOCABS, running_config=running), dtype, seed=1).eval()


def _tokens(shape, seed, *, pad_from=None, left_pad=None):
    t = torch.randint(0, V - 1, shape, generator=torch.Generator().manual_seed(seed))
    for row, at in (pad_from or {}).items():
        t[row, at:] = PAD
    for row, at in (left_pad or {}).items():
        t[row, :at] = PAD
    return t


def _seq2seq_inputs():
    src = _tokens((2, 9), 0, pad_from={1: 6})
    tgt = _tokens((2, 8), 1, pad_from={0: 5})
    return src, tgt, (src != PAD).sum(1)


# ------------------------------------------------------------------------------------------ training: parity


def _run(model, inputs, go, *, cast=True, **kw):
    model.zero_grad(set_to_none=True)
    ctx = contextlib.nullcontext() if cast else no_float32_cast()
    with ctx:
        out = model(*inputs, **kw)
    (out.dec_out * go).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


MODELS = {
    "encoder-decoder, GQA": lambda dtype: (encoder_decoder(dtype), _seq2seq_inputs()),
    "encoder-decoder, attn_scaling, biases": lambda dtype: (
        encoder_decoder(dtype, heads_kv=None, attn_scaling=13.0, add_qkvbias=True, n_positions=1),
        _seq2seq_inputs()),
    "decoder-only, q_gating, left padding": lambda dtype: (
        decoder_only(dtype, q_gating=True), (_tokens((3, 10), 2, pad_from={0: 7}, left_pad={2: 3}), None, None)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_outputs_and_every_gradient_equal_eoles(name, dtype):
    model, inputs = MODELS[name](dtype)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    seq2seq = inputs[1] is not None
    dec_in = inputs[1][:, :-1] if seq2seq else inputs[0]
    real = (dec_in != PAD)[..., None]
    go = torch.randn(*dec_in.shape, 32 if seq2seq else 24, dtype=dtype,
                     generator=torch.Generator().manual_seed(5)) * real
    cast = dtype != torch.float64  # float64: eole's attention without its float32 cast, patched or not
    kw = {} if seq2seq else dict(return_attn=True)  # decoder-only: the last layer's weights, head 0
    want, want_grads = _run(model, inputs, go, cast=cast, **kw)

    report = patch(model)
    assert is_patched(model) and len(report.patched) == (4 if seq2seq else 2)
    assert sorted(report.skipped) == ([f"decoder.transformer_layers.{i}.context_attn" for i in (0, 1)] if seq2seq
                                      else [])
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    got, got_grads = _run(model, inputs, go, cast=cast, **kw)

    # Rows with no key to attend to (left-padded queries) are eole's uniform average, relattn's zeros: compare
    # real tokens; every real token's output and every gradient of a loss on them are the same.
    assert_close(got.dec_out * real, want.dec_out * real, dtype, "dec_out")
    if not seq2seq:
        assert_close(got.attns["std"] * real, want.attns["std"] * real, dtype, "return_attn weights")
    assert set(got_grads) == set(want_grads)
    assert any("relative_positions_embeddings" in n for n in got_grads)  # the tied tables, both terms summed
    for n in want_grads:
        assert_close(got_grads[n], want_grads[n], dtype, n)
    assert unpatch(model) == report.patched and not is_patched(model)


@pytest.mark.parametrize("cached", [False, True])
def test_return_attn_weights_and_the_tied_table_gradient(cached):
    """One decoder SelfMHA, called as eole's decoder calls it: the (B, H, N, M) weights eole returns, the output
    and the gradients of the inputs and of the one table, float64 without eole's cast; cached: a 3-token chunk
    at steps 2..4 of a 7-slot buffer (eole's positions, the only ones eole computes there)."""
    model = encoder_decoder(torch.float64, heads_kv=2)
    attention = model.decoder.transformer_layers[1].self_attn
    x = torch.randn(2, 3 if cached else 6, 32, dtype=torch.float64, requires_grad=True)
    n, m = x.shape[1], 7
    mask = torch.ones(2, 1, n, m, dtype=torch.bool).tril(2 if cached else 0)
    mask[1, ..., 4:] = False  # the second sequence is 4 tokens long
    kwargs = dict(attn_mask=mask, return_attn=True)

    def run():
        if cached:
            g = torch.Generator().manual_seed(3)
            attention.kcache = torch.randn(2, m, 2, 8, generator=g, dtype=torch.float64)
            attention.vcache = torch.randn(2, m, 2, 8, generator=g, dtype=torch.float64)
            kwargs.update(cache_slice=torch.arange(2, 2 + n), cache_seqlens=torch.full((2,), 2))
        out, weights = attention(x, **kwargs)
        attention.kcache = attention.vcache = None
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum() + weights.pow(2).sum()
        table = attention.relative_positions_embeddings.weight
        gx, gt = torch.autograd.grad(loss, (x, table))
        return out, weights, gx, gt

    with no_float32_cast():
        want = run()
    patch(model, positions="eole")
    got = run()
    assert got[1].shape == (2, 4, n, m if cached else n)
    for what, a, b in zip(("out", "weights", "d x", "d table"), got, want, strict=True):
        assert_close(a, b, torch.float64, what)


def test_attention_dropout_reaches_the_op_in_training_only():
    from eole.config.training import TrainingConfig

    running = TrainingConfig(attention_dropout=[0.4], dropout=[0.0])
    model, inputs = encoder_decoder(torch.float64, running=running), _seq2seq_inputs()
    with no_float32_cast():
        want = model(*inputs).dec_out  # eval: no dropout
    patch(model)
    with no_float32_cast():
        assert_close(model(*inputs).dec_out, want, torch.float64, "eval")
    model.train()
    torch.manual_seed(0)
    first = model(*inputs).dec_out
    torch.manual_seed(0)
    assert torch.equal(model(*inputs).dec_out, first)  # the op's dropout, drawn from torch's generator
    assert (first - want).abs().max() > 1e-2


def test_report_skips_what_is_not_shaw_attention_and_refuses_bad_arguments():
    sinusoidal = DecoderModel.build_blocks(TransformerLMModelConfig(
        hidden_size=16, heads=2, transformer_ff=16, layers=1, embeddings={"word_vec_size": 16}), VOCABS)
    with pytest.warns(UserWarning, match="no supported attention"):
        report = patch(sinusoidal)
    assert report.patched == [] and not is_patched(sinusoidal)
    assert "SinusoidalInterleaved: no Shaw relative" in report.skipped["decoder.transformer_layers.0.self_attn"]
    t5 = decoder_only(relative_positions_buckets=8)
    with pytest.warns(UserWarning, match="no supported attention"):
        report = patch(t5)
    assert "T5's bucketed scalar bias" in report.skipped["decoder.transformer_layers.1.self_attn"]
    with pytest.raises(ValueError, match="positions must be one of 'step', 'eole'; got 'absolute'"):
        patch(decoder_only(), positions="absolute")
    with pytest.raises(ValueError, match="backend must be one of"):
        patch(decoder_only(), backend="fast")


# ------------------------------------------------------------------------------------------ cached decoding


def _head(hidden, seed=7):
    w = torch.randn(V, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return lambda h: torch.log_softmax(h @ w.T, -1)


def _greedy_translate(model, src, steps, *, reorder_at=None, order=None):
    """Greedy decoding driven as eole's Translator drives its decoder: ``_init_cache`` at step 0, one token a step,
    ``map_state`` to reorder the batch (beam search's ``select_indices``), ``_extend_cache`` after each step."""
    head = _head(32)
    src_pad = src.eq(PAD).unsqueeze(1)
    enc_out, _ = model.encoder(model.src_emb(src), pad_mask=src_pad)
    tokens = torch.zeros(src.shape[0], 1, dtype=torch.long)  # "BOS" = 0
    logps = []
    for step in range(steps):
        emb = model.tgt_emb(tokens[:, -1:], step=step)
        pad = torch.zeros(tokens.shape[0], 1, 1, dtype=torch.bool)
        if step == 0:
            model.decoder._init_cache(emb, pad, enc_out=enc_out)
        out, _ = model.decoder(emb, enc_out=enc_out, src_pad_mask=src_pad, tgt_pad_mask=pad, step=step)
        lp = head(out[:, -1])
        logps.append(lp)
        tokens = torch.cat([tokens, lp.argmax(-1, keepdim=True)], 1)
        if step == reorder_at:
            model.decoder.map_state(lambda s: s[order])
            tokens, src, src_pad, enc_out = tokens[order], src[order], src_pad[order], enc_out[order]
            logps = [x[order] for x in logps]
        model.decoder._extend_cache()
    model.decoder._disable_cache()
    return tokens, torch.stack(logps, 1), src


def _teacher_forced_translation(model, src, tokens):
    out = model(src, tokens, (src != PAD).sum(1)).dec_out
    return _head(32)(out)


def _gap(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("dynamic", [True, False], ids=["growing cache", "static cache"])
def test_cached_translation_equals_the_teacher_forced_forward_which_eoles_does_not(dynamic):
    running = InferenceConfig(dynamic_shapes=dynamic, self_attn_backend="pytorch")
    model = encoder_decoder(torch.float64, running=running)
    src = _tokens((3, 9), 4, pad_from={1: 6})
    order = torch.tensor([2, 0, 1, 1])  # a beam step: hypotheses reordered and one duplicated
    steps = 9

    with no_float32_cast():
        tokens, eole_logp, src_out = _greedy_translate(model, src, steps, reorder_at=3, order=order)
        eole_gap = _gap(eole_logp, _teacher_forced_translation(model, src_out, tokens))
        patch(model, positions="eole")
        tokens_e, logp_e, _ = _greedy_translate(model, src, steps, reorder_at=3, order=order)
        unpatch(model)
        patch(model)
        tokens_p, logp_p, src_p = _greedy_translate(model, src, steps, reorder_at=3, order=order)
        teacher = _teacher_forced_translation(model, src_p, tokens_p)
    assert eole_gap > 0.1  # eole decodes at other positions than it trains on
    assert torch.equal(tokens_e, tokens) and _gap(logp_e, eole_logp) < 1e-10  # positions="eole": eole's decode
    assert _gap(logp_p, teacher) < 1e-10  # patched: every step's log-probs are the teacher-forced ones


def test_cached_generation_after_a_left_padded_prompt_equals_the_teacher_forced_forward():
    """Decoder-only: a left-padded prompt prefilled in one cached call, then one token a step (growing cache)."""
    model = decoder_only(torch.float64, heads_kv=None)
    head = _head(24, seed=8)
    prompt = _tokens((2, 6), 6, left_pad={1: 2})
    patch(model)
    with no_float32_cast():
        tokens, logps = prompt, []
        for step in range(6):
            x = tokens if step == 0 else tokens[:, -1:]
            emb = model.tgt_emb(x, step=step)
            pad = x.eq(PAD).unsqueeze(1) if step == 0 else torch.zeros(2, 1, 1, dtype=torch.bool)
            if step == 0:
                model.decoder._init_cache(emb, pad)
            out, _ = model.decoder(emb, tgt_pad_mask=pad, step=step)
            lp = head(out[:, -1])
            logps.append(lp)
            tokens = torch.cat([tokens, lp.argmax(-1, keepdim=True)], 1)
            model.decoder._extend_cache()
        model.decoder._disable_cache()
        teacher = head(model(tokens, None, None).dec_out)
    assert _gap(torch.stack(logps, 1), teacher[:, prompt.shape[1] - 1:-1]) < 1e-10


# ------------------------------------------------------------------------------------------ CTranslate2, the peer


def _benchmark_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "eole_models.py"
    spec = importlib.util.spec_from_file_location("eole_models_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ctranslate2_logits_and_greedy_tokens_equal_the_patched_models(tmp_path):
    """The benchmark's peer: the same decoder-only eole model exported to CTranslate2 (its own eole converter
    functions, relative positions, float32) computes the patched model's logits, and the same greedy tokens."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (the 'eole' extra)")
    assert ctranslate2.__version__.startswith("4.")
    bench = _benchmark_module()
    model, cfg = bench.decoder_lm(hidden=32, heads=4, layers=2, ff=48, k=3, vocab=30)
    generator = bench.ctranslate2_generator(model, cfg, str(tmp_path), threads=1)
    patch(model)
    tokens = torch.randint(3, 29, (2, 11), generator=torch.Generator().manual_seed(0))
    truth = bench.eole_logits(model.double(), tokens)
    assert_close(bench.ctranslate2_logits(generator, tokens), truth, torch.float32, "CTranslate2 logits")
    assert_close(bench.eole_logits(model.float(), tokens), truth, torch.float32, "relattn logits")
    prompt = tokens[:, :4]
    assert torch.equal(bench.eole_greedy(model, prompt, 7), bench.ctranslate2_greedy(generator, prompt, 7))


@pytest.mark.slow
def test_benchmark_quick_writes_every_case(tmp_path):
    pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (the 'eole' extra)")
    import json

    bench = _benchmark_module()
    assert bench.main(["--quick", "--threads", "1", "--out", str(tmp_path / "r.json")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(r["case"], r["variant"]) for r in rows if r["case"] != "decode"] == [
        (case, v) for case in ("train", "layer") for v in ("eole", "relattn")]
    decode = [r for r in rows if r["case"] == "decode"]
    assert {(r["batch"], r["variant"]) for r in decode} == {(b, v) for b in (1, 3)
                                                           for v in ("eole", "relattn", "ctranslate2")}
    assert all(r["greedy_tokens_equal"] and r["max_abs_logit_diff"] < 1e-4 and r["tokens_per_s"] > 0
               for r in decode)
