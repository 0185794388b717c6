"""The Hugging Face models and checkpoints more than one test module builds: a tiny VITS, SeamlessM4T (v1)'s speech
encoder config, Transformer-XL biases drawn, a transformers-4 BERT checkpoint with relative positions and that
version's forward written out, and :func:`relative_error` for the checks that two results must differ."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:  # for the checks that two results must differ
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


SEAMLESS_V1 = dict(
    hidden_size=32, speech_encoder_layers=2, speech_encoder_attention_heads=4, speech_encoder_intermediate_size=40,
    feature_projection_input_dim=12, conv_depthwise_kernel_size=3, add_adapter=True, num_adapter_layers=1,
    adaptor_kernel_size=2, adaptor_stride=2, adaptor_dropout=0.0, speech_encoder_layerdrop=0.0,
    position_embeddings_type="relative",
    vocab_size=20, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
    encoder_ffn_dim=16, decoder_ffn_dim=16, t2u_encoder_layers=1, t2u_decoder_layers=1, t2u_encoder_attention_heads=2,
    t2u_decoder_attention_heads=2, t2u_encoder_ffn_dim=16, t2u_decoder_ffn_dim=16, unit_hifi_gan_vocab_size=10,
    t2u_vocab_size=12, upsample_initial_channel=8, unit_embed_dim=8, lang_embed_dim=4, spkr_embed_dim=4,
    vocoder_num_langs=2, vocoder_num_spkrs=2, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
    resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]], variance_predictor_kernel_size=3,
    max_position_embeddings=64, t2u_max_position_embeddings=64)


def with_biases(model):
    """Transformer-XL's u and v start at zero in transformers: drawn here, so that the tests see them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "pos_bias" in name or name.endswith(("bias_u", "bias_v")):
                p.normal_()
    return model


def vits(dropout=0.0, window=4):
    cfg = transformers.VitsConfig(
        vocab_size=20, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, window_size=window,
        ffn_dim=30, ffn_kernel_size=3, flow_size=8, spectrogram_bins=9, upsample_initial_channel=16,
        upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3]], prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=1,
        posterior_encoder_num_wavenet_layers=1, duration_predictor_num_flows=1, duration_predictor_filter_channels=8,
        depth_separable_num_layers=1, hidden_dropout=0.0, attention_dropout=dropout, activation_dropout=0.0,
        layerdrop=0.0)
    return transformers.VitsModel(cfg)


V4 = dict(vocab_size=23, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
          max_position_embeddings=12, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu",
          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.02, pad_token_id=0)


def v4_checkpoint(directory, kind, arch, seed=0):
    """A transformers-4 checkpoint directory: config.json as v4 wrote it, weights under v4's key names (tied
    decoder weight and bias left out, as v4's save_pretrained leaves them out)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, i, p = V4["hidden_size"], V4["intermediate_size"], V4["max_position_embeddings"]
    d = h // V4["num_attention_heads"]
    shapes = {"embeddings.word_embeddings.weight": (V4["vocab_size"], h),
              "embeddings.position_embeddings.weight": (p, h),
              "embeddings.token_type_embeddings.weight": (V4["type_vocab_size"], h),
              "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
    for n in range(V4["num_hidden_layers"]):
        layer = f"encoder.layer.{n}."
        for proj in ("query", "key", "value"):
            shapes |= {f"{layer}attention.self.{proj}.weight": (h, h), f"{layer}attention.self.{proj}.bias": (h,)}
        shapes |= {f"{layer}attention.self.distance_embedding.weight": (2 * p - 1, d),
                   f"{layer}attention.output.dense.weight": (h, h), f"{layer}attention.output.dense.bias": (h,),
                   f"{layer}attention.output.LayerNorm.weight": (h,), f"{layer}attention.output.LayerNorm.bias": (h,),
                   f"{layer}intermediate.dense.weight": (i, h), f"{layer}intermediate.dense.bias": (i,),
                   f"{layer}output.dense.weight": (h, i), f"{layer}output.dense.bias": (h,),
                   f"{layer}output.LayerNorm.weight": (h,), f"{layer}output.LayerNorm.bias": (h,)}
    if arch == "BertModel":
        shapes |= {"pooler.dense.weight": (h, h), "pooler.dense.bias": (h,)}
    else:
        shapes = {f"bert.{k}": s for k, s in shapes.items()}
        shapes |= {"cls.predictions.bias": (V4["vocab_size"],), "cls.predictions.transform.dense.weight": (h, h),
                   "cls.predictions.transform.dense.bias": (h,), "cls.predictions.transform.LayerNorm.weight": (h,),
                   "cls.predictions.transform.LayerNorm.bias": (h,)}
    state = {k: torch.randn(s, generator=g) * (0.3 if len(s) == 2 else 0.1) + (1.0 if "LayerNorm.weight" in k else 0)
             for k, s in shapes.items()}
    directory.mkdir(exist_ok=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = dict(V4, architectures=[arch], model_type="bert", position_embedding_type=kind,
                  transformers_version="4.44.2", use_cache=True, classifier_dropout=None)
    (directory / "config.json").write_text(json.dumps(config))
    return {k: v.double().requires_grad_() for k, v in state.items()}


def v4_reference(state, kind, arch, ids, token_types, mask):
    """transformers 4's BertModel / BertForMaskedLM forward, written from its code, float64."""
    f = torch.nn.functional
    pre = "" if arch == "BertModel" else "bert."
    p, heads = V4["max_position_embeddings"], V4["num_attention_heads"]

    def w(name):
        return state[name if name.startswith("cls.") else pre + name]

    def ln(x, name):
        return f.layer_norm(x, x.shape[-1:], w(name + ".weight"), w(name + ".bias"), eps=1e-12)

    def lin(x, name):
        return x @ w(name + ".weight").T + w(name + ".bias")

    x = ln(w("embeddings.word_embeddings.weight")[ids] + w("embeddings.token_type_embeddings.weight")[token_types],
           "embeddings.LayerNorm")  # relative_key: no absolute position embeddings
    b, n, hidden = x.shape
    extended = (1.0 - mask[:, None, None, :].double()) * torch.finfo(torch.float64).min
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    for layer in range(V4["num_hidden_layers"]):
        at = f"encoder.layer.{layer}."

        def split(t):
            return t.view(b, n, heads, -1).transpose(1, 2)

        q, k, v = (split(lin(x, f"{at}attention.self.{proj}")) for proj in ("query", "key", "value"))
        scores = q @ k.transpose(-1, -2)
        pos = w(f"{at}attention.self.distance_embedding.weight")[distance + p - 1]
        scores = scores + torch.einsum("bhld,lrd->bhlr", q, pos)
        if kind == "relative_key_query":
            scores = scores + torch.einsum("bhrd,lrd->bhlr", k, pos)
        scores = scores / (hidden // heads) ** 0.5 + extended
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, hidden)
        x = ln(lin(ctx, f"{at}attention.output.dense") + x, f"{at}attention.output.LayerNorm")
        inner = f.gelu(lin(x, f"{at}intermediate.dense"))
        x = ln(lin(inner, f"{at}output.dense") + x, f"{at}output.LayerNorm")
    keep = mask[..., None]  # the real tokens, as bert_out
    if arch == "BertModel":
        return x * keep
    t = ln(f.gelu(lin(x, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    return (t @ w("embeddings.word_embeddings.weight").T + state["cls.predictions.bias"]) * keep


def bert_inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V4["vocab_size"], (2, 11), generator=g)
    token_types = torch.randint(0, 2, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, token_types, mask


def bert_out(model, arch, ids, token_types, mask):
    """The output at the real tokens (relattn runs a right-padded batch packed: its padded positions differ)."""
    out = model(input_ids=ids, token_type_ids=token_types, attention_mask=mask)
    return (out.last_hidden_state if arch == "BertModel" else out.logits) * mask[..., None]
