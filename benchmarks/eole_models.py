"""eole models with relative positions, patched by relattn: a training step against eole's own attention, and
greedy decoding against CTranslate2 (where eole models are served), CPU, float32, one run.

- ``train``: an eole transformer-base-shaped encoder-decoder (d_model 512, 8 heads, 6 + 6 layers, FFN 2048,
  ``n_positions`` K = 16) built from its config, one training step (forward, token cross-entropy, backward) at
  B sentences of N source and N target tokens, patched and unpatched (the same weights, interleaved rounds):
  tokens/s (source + target tokens per second) and peak extra memory. ``--attention-dropout`` sets eole's
  ``attention_dropout`` (0.0: relattn's ``native`` kernel serves the calls; > 0: a backend with dropout).
- ``layer``: one decoder ``SelfMHA`` of that model alone, forward+backward under eole's causal mask, patched and
  unpatched.
- ``decode``: a small decoder-only eole model (d 512, 8 heads, 6 layers, K = 16) with its weights exported to a
  CTranslate2 ``TransformerDecoderModelSpec`` (relative positions, float32), greedy generation of ``--new``
  tokens after a ``--prompt``-token prompt at batch 1 and 16: the patched eole model (eole's own decoder and KV
  cache, driven as eole's generator drives it), unpatched eole (its cached positions are wrong: timed only),
  and ``ctranslate2.Generator.generate_batch``. Before timing, the CTranslate2 logits of the prompt are checked
  against the patched model's (``max_abs_logit_diff``) and the greedy tokens against each other.

    PYTHONPATH=src python benchmarks/eole_models.py --out benchmarks/results/eole_models.json
    PYTHONPATH=src python benchmarks/eole_models.py --quick --out /tmp/eole_quick.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import warnings

import torch

from relattn._io import atomic_write_text
from relattn.bench.measure import peak_extra_bytes, time_interleaved
from relattn.integrations.eole import patch, unpatch

with warnings.catch_warnings():  # eole warns that its C++ and flash-attention extensions are missing
    warnings.simplefilter("ignore")
    from eole.config.models import TransformerLMModelConfig, TransformerModelConfig
    from eole.config.training import TrainingConfig
    from eole.models.model import DecoderModel, EncoderDecoderModel


class _Vocab(dict):
    pass


def vocabs(size: int) -> dict:
    """What eole's builders read of a vocabulary: token -> id, the pad token last."""
    v = _Vocab({f"t{i}": i for i in range(size - 1)}, **{"<blank>": size - 1})
    return {"specials": {"pad_token": "<blank>"}, "src": v, "tgt": v}


def _init(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # eole builds its linears with skip_init
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02))
    return model


def transformer_base(*, hidden=512, heads=8, layers=6, ff=2048, k=16, vocab=8000, attention_dropout=0.0):
    cfg = TransformerModelConfig(hidden_size=hidden, heads=heads, transformer_ff=ff, layers=layers,
                                 embeddings={"word_vec_size": hidden, "position_encoding_type": "Relative",
                                             "n_positions": k})
    running = TrainingConfig(attention_dropout=[attention_dropout], dropout=[0.1])
    model = EncoderDecoderModel.build_blocks(cfg, vocabs(vocab), running_config=running)
    model.build_generator(cfg, running, vocabs(vocab))
    return _init(model, 0)


def decoder_lm(*, hidden=512, heads=8, layers=6, ff=2048, k=16, vocab=1000):
    cfg = TransformerLMModelConfig(hidden_size=hidden, heads=heads, transformer_ff=ff, layers=layers,
                                   embeddings={"word_vec_size": hidden, "position_encoding_type": "Relative",
                                               "n_positions": k})
    model = DecoderModel.build_blocks(cfg, vocabs(vocab))
    model.build_generator(cfg, None, vocabs(vocab))
    return _init(model, 1).eval(), cfg


# ------------------------------------------------------------------------------------------ CTranslate2


def ctranslate2_generator(model, cfg, directory: str, *, threads: int):
    """The eole decoder-only ``model`` as a CTranslate2 Generator (float32, CPU): CTranslate2's own eole converter
    functions fill a ``TransformerDecoderModelSpec`` with relative positions (the key table scaled by sqrt(D), the
    value table as it is) from ``model.state_dict()``."""
    import ctranslate2
    from ctranslate2.converters.eole_ct2 import set_transformer_decoder
    from ctranslate2.specs import common_spec, transformer_spec

    spec = transformer_spec.TransformerDecoderModelSpec.from_config(
        cfg.decoder.layers, cfg.decoder.heads, activation=common_spec.Activation.RELU, with_relative_position=True)
    set_transformer_decoder(spec.decoder, model.state_dict(), with_encoder_attention=False)
    tokens = [f"t{i}" for i in range(model.generator.out_features - 1)] + ["<blank>"]
    spec.register_vocabulary(tokens)
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = "t0", "t1", "t2"
    spec.config.layer_norm_epsilon = cfg.decoder.norm_eps
    spec.validate()
    spec.optimize(quantization="float32")
    spec.save(directory)
    return ctranslate2.Generator(directory, device="cpu", compute_type="float32", intra_threads=threads)


def ctranslate2_logits(generator, tokens: torch.Tensor) -> torch.Tensor:
    import numpy as np

    lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.int32)
    import ctranslate2

    out = generator.forward_batch(ctranslate2.StorageView.from_array(tokens.int().numpy()),
                                  ctranslate2.StorageView.from_array(lengths.numpy()))
    return torch.from_numpy(np.array(out))


def eole_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generator(model(tokens, None, None).dec_out)


@torch.no_grad()
def eole_greedy(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy generation as eole's generator drives its decoder: the prompt prefilled in one cached call, then one
    token a step, ``_extend_cache`` after each."""
    decoder, tokens = model.decoder, prompt
    for step in range(new):
        x = tokens if step == 0 else tokens[:, -1:]
        emb = model.tgt_emb(x, step=step)
        pad = torch.zeros(x.shape[0], 1, x.shape[1], dtype=torch.bool)
        if step == 0:
            decoder._init_cache(emb, pad)
        out, _ = decoder(emb, tgt_pad_mask=pad, step=step)
        tokens = torch.cat([tokens, model.generator(out[:, -1]).argmax(-1, keepdim=True)], 1)
        decoder._extend_cache()
    decoder._disable_cache()
    return tokens[:, prompt.shape[1]:]


def ctranslate2_greedy(generator, prompt: torch.Tensor, new: int) -> torch.Tensor:
    start = [[f"t{i}" for i in row] for row in prompt.tolist()]
    results = generator.generate_batch(start, max_length=new, min_length=new, sampling_topk=1, beam_size=1,
                                       include_prompt_in_result=False, end_token=[])
    return torch.tensor([r.sequences_ids[0] for r in results])


# ------------------------------------------------------------------------------------------ the runs


def _median(xs):
    return statistics.median(xs)


def _against_eole(model, call, args, *, case: str, tokens: int) -> list[dict]:
    """``call`` timed (interleaved rounds) and its peak extra memory measured on ``model`` patched and unpatched
    (eole's own code: unpatched for each of its calls), one row per variant; ``tokens`` per call."""
    def unpatched():
        unpatch(model)
        try:
            return call()
        finally:
            patch(model)

    patch(model)
    calls = {"eole": unpatched, "relattn": call}
    times = time_interleaved(calls, args.reps, warmup=1)
    mem = {name: peak_extra_bytes(fn, torch.device("cpu")) for name, fn in calls.items()}
    rows = []
    for name in calls:
        ms = _median(times[name])
        rows.append(dict(case=case, variant=name, batch=args.batch, length=args.length,
                         attention_dropout=args.attention_dropout, ms=ms, min_ms=min(times[name]), all_ms=times[name],
                         tokens_per_s=tokens / ms * 1e3, peak_mb=mem[name] / 2**20))
    for r in rows:
        r["speedup"] = rows[0]["ms"] / r["ms"]
        r["memory_ratio"] = rows[0]["peak_mb"] / max(r["peak_mb"], 1e-9)
    return rows


def run_train(args) -> list[dict]:
    torch.manual_seed(0)
    shape = dict(hidden=64, heads=4, layers=1, ff=96, k=4, vocab=200) if args.quick else {}
    model = transformer_base(attention_dropout=args.attention_dropout, **shape).train()
    v = model.generator.out_features
    pad = v - 1
    src = torch.randint(0, pad, (args.batch, args.length))
    tgt = torch.randint(0, pad, (args.batch, args.length + 1))
    src_len = torch.full((args.batch,), args.length)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        out = model(src, tgt, src_len).dec_out
        loss = torch.nn.functional.cross_entropy(model.generator(out).flatten(0, 1), tgt[:, 1:].flatten())
        grads = torch.autograd.grad(loss, params)
        return loss, grads

    return _against_eole(model, step, args, case="train", tokens=2 * args.batch * args.length)


def run_layer(args) -> list[dict]:
    """One decoder ``SelfMHA`` of the training model, forward+backward under eole's causal & padding mask."""
    shape = dict(hidden=64, heads=4, layers=1, ff=96, k=4, vocab=200) if args.quick else {}
    model = transformer_base(attention_dropout=args.attention_dropout, **shape).train()
    attention = model.decoder.transformer_layers[0].self_attn
    hidden = attention.linear_query.in_features
    x = torch.randn(args.batch, args.length, hidden, generator=torch.Generator().manual_seed(3), requires_grad=True)
    mask = torch.ones(args.length, args.length, dtype=torch.bool).tril().expand(args.batch, 1, -1, -1)
    go = torch.randn(args.batch, args.length, hidden, generator=torch.Generator().manual_seed(4))
    params = [x, *attention.parameters()]

    def call():
        out, _ = attention(x, attn_mask=mask)
        return torch.autograd.grad(out, params, go)

    return _against_eole(model, call, args, case="layer", tokens=args.batch * args.length)


def run_decode(args) -> list[dict]:
    shape = dict(hidden=64, heads=4, layers=2, ff=96, k=4, vocab=100) if args.quick else {}
    model, cfg = decoder_lm(**shape)
    v = model.generator.out_features
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ct2 = ctranslate2_generator(model, cfg, tmp, threads=args.threads)
        probe = torch.randint(3, v - 1, (2, args.prompt + args.new), generator=torch.Generator().manual_seed(2))
        patch(model)
        diff = (ctranslate2_logits(ct2, probe) - eole_logits(model, probe)).abs().max().item()
        for batch in args.decode_batches:
            prompt = torch.randint(3, v - 1, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
            ours = eole_greedy(model, prompt, args.new)
            same = torch.equal(ours, ctranslate2_greedy(ct2, prompt, args.new))

            def relattn_run(prompt=prompt):
                return eole_greedy(model, prompt, args.new)

            def eole_run(prompt=prompt):
                unpatch(model)
                try:
                    return eole_greedy(model, prompt, args.new)
                finally:
                    patch(model)

            def ct2_run(prompt=prompt):
                return ctranslate2_greedy(ct2, prompt, args.new)

            times = time_interleaved({"eole": eole_run, "relattn": relattn_run, "ctranslate2": ct2_run}, args.reps)
            ct2_ms = _median(times["ctranslate2"])
            for name, ts in times.items():
                ms = _median(ts)
                rows.append(dict(case="decode", variant=name, batch=batch, prompt=args.prompt, new=args.new, ms=ms,
                                 min_ms=min(ts), all_ms=ts,
                                 tokens_per_s=batch * args.new / ms * 1e3, vs_ctranslate2=ms / ct2_ms,
                                 max_abs_logit_diff=diff, greedy_tokens_equal=same))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("train", "layer", "decode"), default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--attention-dropout", type=float, default=0.0)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny models and sizes: checks the script in seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.length, args.prompt, args.new, args.reps = 2, 16, 4, 6, 1
        args.decode_batches = [1, 3]
    torch.set_num_threads(args.threads)
    rows = []
    if args.only in (None, "train"):
        rows += run_train(args)
    if args.only in (None, "layer"):
        rows += run_layer(args)
    if args.only in (None, "decode"):
        rows += run_decode(args)
    for r in rows:
        extra = (f"x{r['speedup']:.2f} eole, peak {r['peak_mb']:.0f} MB" if r["case"] != "decode" else
                 f"{r['vs_ctranslate2']:.2f} x CTranslate2's time, logits diff {r['max_abs_logit_diff']:.1e}, "
                 f"greedy equal {r['greedy_tokens_equal']}")
        print(f"{r['case']:6} B={r['batch']:<3} {r['variant']:12} {r['ms']:10.1f} ms (best {r['min_ms']:.1f})"
              f" {r['tokens_per_s']:10.1f} tok/s"
              f"  {extra}")
    if args.out:
        import ctranslate2

        meta = dict(command=" ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
                    machine=platform.processor() or platform.machine(), threads=args.threads,
                    torch=torch.__version__, ctranslate2=ctranslate2.__version__)
        atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
