"""The Hugging Face helpers say what is so: ``is_patched(model)`` for a model holding patched modules, and a
patched Wav2Vec2-BERT asked for ``output_attentions`` returns the unpatched model's weights, never ``()``."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from relattn.integrations.transformers import is_patched, patch, unpatch  # noqa: E402


def _w2v_bert(impl: str):
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=20,
        feature_projection_input_dim=8, position_embeddings_type="relative_key", left_max_position_embeddings=4,
        right_max_position_embeddings=2, conv_depthwise_kernel_size=3, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, conformer_conv_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0, attn_implementation=impl)
    return transformers.Wav2Vec2BertModel(cfg).double().eval()


def test_is_patched_is_true_for_the_model_and_false_after_unpatch():
    model = _w2v_bert("eager")
    assert not is_patched(model)
    patch(model)
    assert is_patched(model) and is_patched(model.encoder.layers[0].self_attn)
    assert not is_patched(model.encoder.layers[0].ffn1)
    unpatch(model)
    assert not is_patched(model)


@pytest.mark.parametrize("impl", ["eager", pytest.param("sdpa", marks=pytest.mark.slow)])
def test_output_attentions_of_a_patched_wav2vec2_bert_are_the_unpatched_weights(impl):
    plain = _w2v_bert("eager")
    patched = copy.deepcopy(plain)
    patched.config._attn_implementation = impl
    patch(patched)
    x = torch.randn(2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    want = plain(input_features=x, attention_mask=mask, output_attentions=True)
    got = patched(input_features=x, attention_mask=mask, output_attentions=True)
    assert len(want.attentions) == len(got.attentions) == 2
    for g, w in zip(got.attentions, want.attentions, strict=True):
        valid = mask[:, None, :, None].bool()  # the padded queries' rows are whatever each computes
        torch.testing.assert_close(g * valid, w * valid, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-10, atol=1e-10)
    quiet = patched(input_features=x, attention_mask=mask)
    assert quiet.attentions is None
