"""Hugging Face models with Shaw attention, patched by relattn, against their unpatched selves: CPU, float32, time and
peak extra memory of a forward and of a forward+backward, in one run.

Cases (defaults; ``--quick`` shrinks every size to seconds):

- ``w2v-bert/attention``: one Wav2Vec2-BERT self-attention layer of w2v-bert-2.0's shape (hidden 1024, 16 heads,
  window [-64, +8]) at 1500 and 6000 frames (30 s and 2 min of audio); ``w2v-bert/model``: the model with
  ``--layers`` conformer layers. Unpatched: ``attn_implementation`` "eager" and "sdpa" (the same weights).
- ``vits/text-encoder``: the VITS text encoder of facebook/mms-tts' shape (hidden 192, 2 heads, 6 layers,
  window 4, key and value tables) at 100 and 500 tokens. Unpatched: its own attention (it has no sdpa).
- ``speecht5/encoder``: SpeechT5's encoder (hidden 768, 12 heads, ``--layers`` layers, table of 320 rows) at
  500 and 1500 frames. Unpatched: its own attention (eager).
- ``bert-relative-key-query/model``: a BERT-base-shaped ``relative_key_query`` model (``--layers`` layers) from
  ``load_bert_relative_key`` at 512 tokens. Unpatched: transformers 4's formula (an (N, N, D) embedding and two
  einsums), as ``v4-eager``; transformers 5 has no relative BERT of its own.
- ``deberta-v3-base/attention``: one DeBERTa-v3-base attention (``DebertaV2Attention``: hidden 768, 12 heads, 256
  log buckets, max 512, shared keys, c2p and p2c) at 512, 2048 and 8192 tokens, with what its encoder hands it
  (unpatched: the (B, 1, N, N) mask and (1, N, N) positions it builds, timed with it; patched: a padding mask);
  ``deberta-v3-base/model``: ``DebertaV2Model`` with ``--layers`` layers; ``--batch`` sequences per call (1).
  Unpatched: transformers' eager path (DeBERTa has no sdpa). ``--ragged 64-512``: instead, the model on one padded
  batch of ``--batch`` (8) sequences of lengths spread evenly over 64..512, right-padded to 512 (the patched encoder
  runs it packed), its output at the real tokens.
- ``parakeet-0.6b/attention``: one Parakeet (FastConformer) attention layer of parakeet-0.6B's shape (hidden 1024,
  8 heads; Transformer-XL's biases and a (2N - 1)-row table), with what its encoder hands it (its own position
  module's (1, 2N - 1, E) output, one sequence, no padding mask) at 1500 and 8192 frames (2 min and 11 min of
  audio after 8x subsampling). Unpatched: ``attn_implementation`` "eager" and "sdpa".
- ``t5-base/encoder``: T5-base's encoder (hidden 768, 12 heads, 32 buckets, ``--layers`` layers, dropout 0, train
  mode) at B = 4 x 512 and B = 1 x 2048 tokens. Unpatched: ``attn_implementation`` "eager" and "sdpa" (the bias a
  (1, H, N, N) tensor that needs a gradient).
- ``mpnet-base/model``: all-mpnet-base-v2's shape (``MPNetModel``, hidden 768, 12 heads, 12 layers): one ragged batch
  of 32 sentences of 16..384 tokens right-padded to 384 (the patched model runs it packed), its output at the real
  tokens, and B = 16 x 384 unpadded. Unpatched: eager (MPNet has no sdpa).
- ``flan-t5-base/generate``: Flan-T5-base's shape (``T5ForConditionalGeneration``, 12 + 12 layers, hidden 768, 12 heads,
  gated-GELU, its 32128-token vocabulary) greedily generating ``--new`` (64) tokens after 512 input tokens, batch 1,
  with transformers' cache; time and peak memory of one ``generate()``, mode "generate" whatever ``--modes`` says;
  ``max_abs_diff`` counts the tokens that differ from relattn's. Unpatched: "eager" and "sdpa".

Every variant runs the same weights and inputs (the model is patched and unpatched in place between calls). Time:
medians of ``--reps`` interleaved rounds after a warm-up; forward under ``torch.no_grad()``, forward+backward
with a fixed output gradient into the parameters. Memory: relattn's bench method (peak live bytes of PyTorch's CPU
allocator during one call, from torch.profiler). Ratios are unpatched / relattn (> 1: relattn faster or smaller);
``max_abs_diff`` is each unpatched variant's forward output against relattn's.
A variant predicted to need more than ``--max-gb`` is skipped and says so.

    PYTHONPATH=src python benchmarks/hf_models.py --out benchmarks/results/hf_models.json
    PYTHONPATH=src python benchmarks/hf_models.py --quick --out /tmp/hf_quick.json
    PYTHONPATH=src python benchmarks/hf_models.py --only w2v-bert --lengths 1500 --layers 1 --reps 3
    PYTHONPATH=src python benchmarks/hf_models.py --only deberta --ragged 64-512 --threads 2 --out /tmp/ragged.json
    PYTHONPATH=src python benchmarks/hf_models.py --only t5 --threads 2 --modes forward+backward --out /tmp/t5.json
    PYTHONPATH=src python benchmarks/hf_models.py --only mpnet --threads 2 --modes forward --out /tmp/mpnet.json
    PYTHONPATH=src python benchmarks/hf_models.py --only flan-t5 --threads 2 --reps 3 --out /tmp/flan_t5.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relattn._io import atomic_write_text
from relattn.backends import cpu as cpu_choice
from relattn.backends import native
from relattn.bench.measure import peak_extra_bytes

RESULTS = Path(__file__).resolve().parent / "results"  # where results go unless --out says otherwise

MODES = ("forward", "forward+backward")


@dataclass
class Case:
    """One model at one length: ``variants`` name -> a function putting the model in that state."""

    model: str
    scope: str
    length: int
    run: object  # () -> output tensor, with the model in its current state
    variants: dict
    params: list
    estimate_gb: dict = field(default_factory=dict)  # unpatched variant -> predicted peak GB (fwd+bwd)
    generate: bool = False  # run() generates tokens: timed once, as "generate", whatever the modes asked


def _w2v(quick: bool, layers: int):
    import transformers

    if quick:
        shape = dict(hidden_size=64, num_attention_heads=4, intermediate_size=96, left_max_position_embeddings=6,
                     right_max_position_embeddings=2, feature_projection_input_dim=16, conv_depthwise_kernel_size=5)
    else:
        shape = dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, left_max_position_embeddings=64,
                     right_max_position_embeddings=8, feature_projection_input_dim=160, conv_depthwise_kernel_size=31)
    cfg = transformers.Wav2Vec2BertConfig(
        num_hidden_layers=layers, position_embeddings_type="relative_key", add_adapter=False, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
        attn_implementation="eager", **shape)
    return transformers.Wav2Vec2BertModel(cfg).eval(), shape


def _states(model, patched_from=None):
    """Variant setters: unpatched with each attn_implementation given, and "relattn" (patched)."""
    from relattn.integrations.transformers import patch, unpatch

    def unpatched(impl):
        def set_state():
            unpatch(model)
            if impl is not None:
                model.set_attn_implementation(impl)
        return set_state

    def patched():
        if not any("forward" in m.__dict__ for m in model.modules()):
            patch(model)

    return unpatched, patched


def w2v_cases(quick: bool, layers: int, lengths: list[int]) -> list[Case]:
    model, shape = _w2v(quick, layers)
    unpatched, patched = _states(model)
    heads, dim = shape["num_attention_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    variants = {"eager": unpatched("eager"), "sdpa": unpatched("sdpa"), "relattn": patched}
    cases = []
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        attn = model.encoder.layers[0].self_attn
        h = torch.randn(1, n, shape["hidden_size"], generator=g, requires_grad=True)
        x = torch.randn(1, n, shape["feature_projection_input_dim"], generator=g)
        one = n * n * 4 / 1e9  # GB of one (N, N) float32 map
        est = {"eager": one * (2 * dim + 5 * heads), "sdpa": one * (2 * dim + 3 * heads)}
        cases.append(Case("w2v-bert", "attention", n, lambda a=attn, h=h: a(h)[0], variants,
                          [h, *attn.parameters()], est))
        cases.append(Case("w2v-bert", f"model ({layers} layers)", n, lambda x=x: model(x).last_hidden_state, variants,
                          list(model.parameters()), {k: v * layers for k, v in est.items()}))
    return cases


def vits_cases(quick: bool, lengths: list[int]) -> list[Case]:
    import transformers

    shape = dict(hidden_size=24, num_attention_heads=2, ffn_dim=48, num_hidden_layers=2) if quick else dict(
        hidden_size=192, num_attention_heads=2, ffn_dim=768, num_hidden_layers=6)
    cfg = transformers.VitsConfig(vocab_size=40, window_size=4, ffn_kernel_size=3, hidden_dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, **shape)
    model = transformers.VitsModel(cfg).eval()
    unpatched, patched = _states(model)
    cases = []
    for n in lengths:
        ids = torch.randint(1, 40, (1, n), generator=torch.Generator().manual_seed(n))
        pad = torch.ones(1, n, 1)

        def run(ids=ids, pad=pad):
            return model.text_encoder(input_ids=ids, padding_mask=pad).last_hidden_state

        one = n * n * 4 / 1e9
        cases.append(Case("vits", "text-encoder", n, run, {"eager": unpatched(None), "relattn": patched},
                          list(model.text_encoder.parameters()), {"eager": one * 8 * shape["num_hidden_layers"]}))
    return cases


def speecht5_cases(quick: bool, layers: int, lengths: list[int]) -> list[Case]:
    import transformers
    from transformers.models.speecht5.modeling_speecht5 import SpeechT5EncoderWithoutPrenet

    shape = dict(hidden_size=32, encoder_attention_heads=4, encoder_ffn_dim=48, encoder_max_relative_position=8) \
        if quick else dict(hidden_size=768, encoder_attention_heads=12, encoder_ffn_dim=3072,
                           encoder_max_relative_position=160)
    cfg = transformers.SpeechT5Config(encoder_layers=layers, hidden_dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0, encoder_layerdrop=0.0, **shape)
    model = SpeechT5EncoderWithoutPrenet(cfg).eval()
    unpatched, patched = _states(model)
    dim = shape["hidden_size"] // shape["encoder_attention_heads"]
    cases = []
    for n in lengths:
        x = torch.randn(1, n, shape["hidden_size"], generator=torch.Generator().manual_seed(n))
        one = n * n * 4 / 1e9
        cases.append(Case("speecht5", f"encoder ({layers} layers)", n, lambda x=x: model(x).last_hidden_state,
                          {"eager": unpatched(None), "relattn": patched}, list(model.parameters()),
                          {"eager": one * (2 * dim + 4 * shape["encoder_attention_heads"]) * layers}))
    return cases


def _v4_forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
    """transformers 4's BertSelfAttention with relative_key(_query), as it computed it."""
    b, n, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).view(b, n, self.num_attention_heads, -1).transpose(1, 2)
               for proj in (self.query, self.key, self.value))
    scores = q @ k.transpose(-1, -2)
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    pos = self.distance_embedding(distance + self.max_position_embeddings - 1).to(q.dtype)
    scores = scores + torch.einsum("bhld,lrd->bhlr", q, pos)
    if self.position_embedding_type == "relative_key_query":
        scores = scores + torch.einsum("bhrd,lrd->bhlr", k, pos)
    scores = scores / math.sqrt(q.shape[-1])
    if attention_mask is not None:
        scores = scores + attention_mask
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, n, -1), None


def bert_cases(quick: bool, layers: int, lengths: list[int], kind: str = "relative_key_query") -> list[Case]:
    import types

    import transformers
    from safetensors.torch import save_file

    from relattn.integrations.bert import load_bert_relative_key

    shape = dict(hidden_size=32, num_attention_heads=4, intermediate_size=48, max_position_embeddings=64) if quick \
        else dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512)
    cfg = transformers.BertConfig(vocab_size=1000, num_hidden_layers=layers, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, **shape)
    state = {k: v.contiguous() for k, v in transformers.BertModel(cfg).state_dict().items()}
    p, dim = shape["max_position_embeddings"], shape["hidden_size"] // shape["num_attention_heads"]
    for i in range(layers):
        state[f"encoder.layer.{i}.attention.self.distance_embedding.weight"] = 0.02 * torch.randn(2 * p - 1, dim)
    with tempfile.TemporaryDirectory() as tmp:
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config = dict(cfg.to_dict(), architectures=["BertModel"], position_embedding_type=kind)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        model = load_bert_relative_key(tmp).eval()
    attention = [m for m in model.modules() if hasattr(m, "distance_embedding")]
    patched_forwards = [m.forward for m in attention]

    def v4():
        for m in attention:
            m.forward = types.MethodType(_v4_forward, m)

    def relattn():
        for m, f in zip(attention, patched_forwards, strict=True):
            m.forward = f

    cases = []
    for n in lengths:
        ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n))
        one = n * n * 4 / 1e9
        cases.append(Case(f"bert-{kind.replace('_', '-')}", f"model ({layers} layers)", n,
                          lambda ids=ids: model(input_ids=ids).last_hidden_state, {"v4-eager": v4, "relattn": relattn},
                          list(model.parameters()), {"v4-eager": one * (2 * dim + 6 * shape["num_attention_heads"])
                                                     * layers}))
    return cases


def ragged_lengths(lo: int, hi: int, batch: int) -> list[int]:
    """``batch`` lengths spread evenly over ``lo .. hi`` (both included)."""
    return [round(lo + (hi - lo) * i / max(batch - 1, 1)) for i in range(batch)]


def deberta_cases(quick: bool, layers: int, lengths: list[int], batch: int = 1,
                  ragged: tuple[int, int] | None = None) -> list[Case]:
    import transformers

    from relattn.integrations.transformers import is_patched

    shape = dict(hidden_size=32, num_attention_heads=4, intermediate_size=48, position_buckets=8,
                 max_relative_positions=20) if quick else dict(
        hidden_size=768, num_attention_heads=12, intermediate_size=3072, position_buckets=256,
        max_relative_positions=512)
    cfg = transformers.DebertaV2Config(
        vocab_size=1000, num_hidden_layers=layers, relative_attention=True, pos_att_type=["p2c", "c2p"],
        share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, max_position_embeddings=512,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **shape)
    model = transformers.DebertaV2Model(cfg).eval()
    unpatched, patched = _states(model)
    encoder, heads = model.encoder, shape["num_attention_heads"]
    variants = {"eager": unpatched(None), "relattn": patched}
    if ragged is not None:
        return [_ragged_deberta(model, variants, layers, ragged, batch, heads)]
    cases = []
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        h = torch.randn(batch, n, shape["hidden_size"], generator=g, requires_grad=True)
        padding = torch.ones(batch, n)
        ids = torch.randint(1, 1000, (batch, n), generator=g)

        def attention(h=h, padding=padding):
            if is_patched(encoder):
                mask, positions = padding[:, None, None, :], None
            else:
                mask, positions = encoder.get_attention_mask(padding), encoder.get_rel_pos(h)
            return encoder.layer[0].attention(h, mask, relative_pos=positions,
                                              rel_embeddings=encoder.get_rel_embedding())[0]

        one = batch * n * n * 4 / 1e9  # GB of one (N, N) float32 map per batch entry
        est = {"eager": one * 7 * heads}  # measured fwd+bwd peak: 6.2 (N, N) maps per head at N = 2048
        at = "" if batch == 1 else f" (batch {batch})"
        cases.append(Case("deberta-v3-base", f"attention{at}", n, attention, variants,
                          [h, *encoder.layer[0].attention.parameters(), *encoder.rel_embeddings.parameters(),
                           *encoder.LayerNorm.parameters()], est))
        cases.append(Case("deberta-v3-base", f"model ({layers} layers){at}", n,
                          lambda ids=ids: model(input_ids=ids).last_hidden_state, variants, list(model.parameters()),
                          {"eager": est["eager"] * layers}))
    return cases


def _ragged_deberta(model, variants, layers: int, ragged: tuple[int, int], batch: int, heads: int) -> Case:
    """The model on a padded batch: ``batch`` sequences of lengths spread over ``ragged`` = (lo, hi), right-padded to
    hi (as a tokenizer pads), its output at the real tokens (the padding's output multiplied by 0: the loss of a
    training step reads real tokens only)."""
    lo, hi = ragged
    lengths = ragged_lengths(lo, hi, batch)
    g = torch.Generator().manual_seed(hi)
    ids = torch.randint(1, 1000, (batch, hi), generator=g)
    mask = (torch.arange(hi)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask  # padding token 0
    keep = mask[..., None].float()

    def run():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state * keep

    est = batch * hi * hi * 4 / 1e9 * 7 * heads * layers
    return Case("deberta-v3-base", f"model ({layers} layers) ragged {lo}-{hi} x{batch}", hi, run, variants,
                list(model.parameters()), {"eager": est})


def parakeet_cases(quick: bool, lengths: list[int]) -> list[Case]:
    import transformers

    shape = dict(hidden_size=64, num_attention_heads=4, intermediate_size=96) if quick else dict(
        hidden_size=1024, num_attention_heads=8, intermediate_size=4096)
    cfg = transformers.ParakeetEncoderConfig(num_hidden_layers=1, dropout=0.0, layerdrop=0.0, activation_dropout=0.0,
                                             attention_dropout=0.0, attn_implementation="eager", **shape)
    model = transformers.ParakeetEncoder(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:  # transformers starts them at zero
            layer.self_attn.bias_u.normal_(std=0.1)
            layer.self_attn.bias_v.normal_(std=0.1)
    unpatched, patched = _states(model)
    attn, heads = model.layers[0].self_attn, shape["num_attention_heads"]
    cases = []
    for n in lengths:
        h = torch.randn(1, n, shape["hidden_size"], generator=torch.Generator().manual_seed(n), requires_grad=True)
        positions = model.encode_positions(h).detach()
        one = n * n * 4 / 1e9  # GB of one (N, N) float32 map; the position scores are (N, 2N - 1) before the shift
        est = {"eager": one * 9 * heads, "sdpa": one * 8 * heads}
        cases.append(Case("parakeet-0.6b", "attention", n, lambda h=h, p=positions: attn(h, p)[0],
                          {"eager": unpatched("eager"), "sdpa": unpatched("sdpa"), "relattn": patched},
                          [h, *attn.parameters()], est))
    return cases


def t5_cases(quick: bool, layers: int, lengths: list[int]) -> list[Case]:
    import transformers

    shape = dict(d_model=32, d_kv=8, d_ff=48, num_heads=4) if quick else dict(d_model=768, d_kv=64, d_ff=3072,
                                                                             num_heads=12)
    cfg = transformers.T5Config(vocab_size=1000, num_layers=layers, dropout_rate=0.0, attn_implementation="eager",
                                **shape)
    model = transformers.T5EncoderModel(cfg).train()
    unpatched, patched = _states(model)
    heads = shape["num_heads"]
    cases = []
    for n in lengths:
        batch = 4 if n <= 512 else 1
        ids = torch.randint(1, 1000, (batch, n), generator=torch.Generator().manual_seed(n))
        one = batch * n * n * 4 / 1e9
        est = {"eager": one * 5 * heads * layers, "sdpa": one * 4 * heads * layers}
        cases.append(Case("t5-base", f"encoder ({layers} layers) x{batch}", n,
                          lambda ids=ids: model(input_ids=ids).last_hidden_state,
                          {"eager": unpatched("eager"), "sdpa": unpatched("sdpa"), "relattn": patched},
                          list(model.parameters()), est))
    return cases


def mpnet_cases(quick: bool, lengths: list[int]) -> list[Case]:
    import transformers

    shape = dict(hidden_size=32, num_attention_heads=4, intermediate_size=48, num_hidden_layers=2) if quick else \
        dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=12)
    cfg = transformers.MPNetConfig(vocab_size=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                   max_position_embeddings=514, **shape)
    model = transformers.MPNetModel(cfg, add_pooling_layer=False).eval()
    unpatched, patched = _states(model)
    variants = {"eager": unpatched(None), "relattn": patched}
    hi = max(lengths)
    lo, batch = (4, 8) if quick else (16, 32)
    sizes = ragged_lengths(lo, hi, batch)
    g = torch.Generator().manual_seed(hi)
    ids = torch.randint(3, 1000, (batch, hi), generator=g)
    mask = (torch.arange(hi)[None, :] < torch.tensor(sizes)[:, None]).long()
    ids = ids * mask + (1 - mask)  # MPNet's padding token 1
    keep = mask[..., None].float()
    full = torch.randint(3, 1000, (batch // 2, hi), generator=g)
    return [Case("mpnet-base", f"model ragged {lo}-{hi} x{batch}", hi,
                 lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state * keep, variants,
                 list(model.parameters())),
            Case("mpnet-base", f"model x{batch // 2}", hi,
                 lambda: model(input_ids=full, attention_mask=torch.ones_like(full)).last_hidden_state, variants,
                 list(model.parameters()))]


def flan_t5_cases(quick: bool, lengths: list[int], new: int) -> list[Case]:
    """Flan-T5-base's shape (``T5ForConditionalGeneration``: 12 + 12 layers, hidden 768, 12 heads, gated-GELU FFN
    2048, 32 buckets, its 32128-token vocabulary, untied head) greedily generating ``new`` tokens (no early stop)
    after each of ``lengths`` input tokens, batch 1, with transformers' cache."""
    import transformers

    shape = dict(d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=2, vocab_size=100) if quick else dict(
        d_model=768, d_kv=64, d_ff=2048, num_heads=12, num_layers=12, vocab_size=32128)
    cfg = transformers.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                attn_implementation="eager", **shape)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    unpatched, patched = _states(model)
    cases = []
    for n in lengths:
        ids = torch.randint(2, shape["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, num_beams=1)
        cases.append(Case("flan-t5-base", f"generate {new} tokens (greedy)", n, lambda kw=kw: model.generate(**kw),
                          {"eager": unpatched("eager"), "sdpa": unpatched("sdpa"), "relattn": patched}, [],
                          generate=True))
    return cases


def _step(case: Case, mode: str, grad: torch.Tensor):
    if mode in ("forward", "generate"):
        def run():
            with torch.no_grad():
                return case.run()
        return run

    def run():
        out = case.run()
        return torch.autograd.grad(out, case.params, grad, allow_unused=True)
    return run


def _interleaved(variants: dict, step, reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per ``step()`` for each variant: ``warmup`` untimed calls each, then ``reps`` rounds taking the
    variants in turn (putting the model in a variant's state is not timed)."""
    for setter in variants.values():
        setter()
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, setter in variants.items():
            setter()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def measure(case: Case, reps: int, warmup: int, max_gb: float, modes=MODES) -> list[dict]:
    """Both modes of one case: ms and peak extra MB per variant, and unpatched/relattn ratios."""
    skipped = {name: f"predicted {gb:.1f} GB > --max-gb {max_gb:g}" for name, gb in case.estimate_gb.items()
               if gb > max_gb}
    live = {name: setter for name, setter in case.variants.items() if name not in skipped}
    outputs = {}
    with torch.no_grad():
        for name, setter in live.items():
            setter()
            outputs[name] = case.run()
    ours = outputs["relattn"]
    if case.generate:  # tokens: how many differ from relattn's
        grad, modes = None, ("generate",)
        agreement = {name: float((out != ours).sum()) if out.shape == ours.shape else float("inf")
                     for name, out in outputs.items() if name != "relattn"}
    else:
        grad = torch.randn_like(ours)
        agreement = {name: (out - ours).abs().max().item() for name, out in outputs.items() if name != "relattn"}
    rows = []
    for mode in modes:
        times = _interleaved(live, _step(case, mode, grad), reps, warmup)
        row = {"model": case.model, "scope": case.scope, "length": case.length, "mode": mode, "variants": {},
               "skipped": skipped, "speedup": {}, "memory_ratio": {},
               "max_abs_diff": agreement}
        for name, setter in live.items():
            setter()
            peak = peak_extra_bytes(_step(case, mode, grad), torch.device("cpu"))
            row["variants"][name] = {"ms": statistics.median(times[name]) * 1e3, "times_s": times[name],
                                     "peak_mb": peak / 1e6}
        ours = row["variants"]["relattn"]
        for name, v in row["variants"].items():
            if name != "relattn":
                row["speedup"][name] = v["ms"] / ours["ms"]
                row["memory_ratio"][name] = v["peak_mb"] / ours["peak_mb"] if ours["peak_mb"] > 0 else float("inf")
        rows.append(row)
        print(f"{case.model:>24} {case.scope:>20} N={case.length:<5} {mode:>16}  "
              + "  ".join(f"{n}: {v['ms']:9.1f} ms {v['peak_mb']:8.1f} MB" for n, v in row["variants"].items())
              + "  | x faster " + ", ".join(f"{k} {r:.2f}" for k, r in row["speedup"].items())
              + " | x less memory " + ", ".join(f"{k} {r:.2f}" for k, r in row["memory_ratio"].items())
              + (f" | skipped {skipped}" if skipped else ""), flush=True)
    return rows


def plan(quick: bool, layers: int) -> dict[str, list[int]]:
    """Lengths per model family."""
    if quick:
        return {"w2v-bert": [40], "vits": [20], "speecht5": [30], "bert": [48], "deberta": [40], "parakeet": [40],
                "t5": [40], "mpnet": [40], "flan-t5": [40]}
    return {"w2v-bert": [1500, 6000], "vits": [100, 500], "speecht5": [500, 1500], "bert": [512],
            "deberta": [512, 2048, 8192], "parakeet": [1500, 8192], "t5": [512, 2048], "mpnet": [384],
            "flan-t5": [512]}


FAMILIES = ("w2v-bert", "vits", "speecht5", "bert", "deberta", "parakeet", "t5", "mpnet", "flan-t5")


def build_cases(quick: bool, layers: int, only=FAMILIES, lengths: list[int] | None = None,
                batch: int = 1, ragged: tuple[int, int] | None = None, new: int = 64) -> list[Case]:
    """The cases of the families in ``only``, at their lengths (or at ``lengths``, for all of them); DeBERTa's with
    ``batch`` sequences, or (``ragged`` = (lo, hi)) its model on one padded batch of lengths spread over lo..hi."""
    at = {f: lengths or n for f, n in plan(quick, layers).items()}
    builders = {"w2v-bert": lambda: w2v_cases(quick, layers, at["w2v-bert"]),
                "vits": lambda: vits_cases(quick, at["vits"]),
                "speecht5": lambda: speecht5_cases(quick, layers, at["speecht5"]),
                "bert": lambda: bert_cases(quick, layers, at["bert"]),
                "deberta": lambda: deberta_cases(quick, layers, at["deberta"], batch, ragged),
                "parakeet": lambda: parakeet_cases(quick, at["parakeet"]),
                "t5": lambda: t5_cases(quick, layers, at["t5"]),
                "mpnet": lambda: mpnet_cases(quick, at["mpnet"]),
                "flan-t5": lambda: flan_t5_cases(quick, at["flan-t5"], new)}
    return [case for family in only for case in builders[family]()]


def _machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpu_features": cpu_choice.features().describe(), "native_choice": native.choice().describe(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(), "python": platform.python_version()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 rep: checks the script, measures nothing")
    p.add_argument("--layers", type=int, default=None, help="layers of the w2v-BERT, SpeechT5 and BERT models (2)")
    p.add_argument("--reps", type=int, default=None, help="timed interleaved rounds (5; --quick 1)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-gb", type=float, default=None, help="skip a variant predicted to need more (default: "
                   "half of MemAvailable)")
    p.add_argument("--only", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="model families to run")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="lengths for every family run "
                   "(default: each family's own)")
    p.add_argument("--batch", type=int, default=None, help="sequences per DeBERTa call (default 1; --ragged 8)")
    p.add_argument("--ragged", default=None, metavar="LO-HI", help="DeBERTa's model on one right-padded batch of "
                   "--batch sequences, lengths spread evenly over LO..HI (e.g. 64-512), patched vs eager")
    p.add_argument("--new", type=int, default=None, help="tokens Flan-T5 generates (64; --quick 6)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what to time")
    p.add_argument("--scopes", nargs="+", default=None, help="only the cases whose scope starts with one of these "
                   "(e.g. attention, model)")
    p.add_argument("--out", default=RESULTS / "hf_models.json", help="JSON results (default: %(default)s)")
    args = p.parse_args(argv)
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    layers = args.layers or (1 if args.quick else 2)
    reps = args.reps or (1 if args.quick else 5)
    max_gb = args.max_gb or _available_gb() / 2
    ragged = None
    if args.ragged is not None:
        try:
            ragged = tuple(int(x) for x in args.ragged.split("-"))
            if len(ragged) != 2 or not 0 < ragged[0] <= ragged[1]:
                raise ValueError
        except ValueError:
            p.error(f"--ragged must be LO-HI with 0 < LO <= HI, got {args.ragged!r}")
    batch = args.batch or (8 if ragged else 1)
    torch.manual_seed(0)
    rows = []
    print(f"CPU {_machine()['cpu_features']}\nnative kernel: {_machine()['native_choice']}", flush=True)
    new = args.new or (6 if args.quick else 64)
    for case in build_cases(args.quick, layers, args.only, args.lengths, batch, ragged, new):
        if args.scopes is None or case.scope.startswith(tuple(args.scopes)):
            rows.extend(measure(case, reps, args.warmup, max_gb, args.modes))
    result = {"machine": _machine(), "torch": torch.__version__, "transformers": transformers.__version__,
              "quick": args.quick, "layers": layers, "reps": reps, "max_gb": max_gb, "command": sys.argv,
              "memory_method": "relattn.bench.measure.peak_extra_bytes (torch.profiler CPU allocator events)",
              "rows": rows}
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


def _available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1e6
    except (OSError, StopIteration):
        return 8.0


if __name__ == "__main__":
    raise SystemExit(main())
