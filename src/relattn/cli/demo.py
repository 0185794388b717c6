"""``relattn demo``: the spec's walkthrough, end to end, in a few seconds."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from .. import reference as ref
from .._io import check_output_dir, save_figure
from ..functional import relative_attention, relative_attention_weights
from ..modules import RelativeMultiheadAttention
from ..positions import relative_position_index

# The spec's "Testing the implementation" example.
SEQ_LEN, EMBED_DIM, D_K, D_V, MAX_DIST = 6, 8, 4, 4, 3
INPUT_SEED, LAYER_SEED = 42, 123


def spec_example() -> tuple[np.ndarray, ref.RelativeSelfAttention]:
    """The spec's input ``X`` (np.random.seed(42); randn(6, 8)) and layer (seed=123), without global RNG."""
    x = np.random.RandomState(INPUT_SEED).randn(SEQ_LEN, EMBED_DIM)
    return x, ref.RelativeSelfAttention(EMBED_DIM, D_K, D_V, max_distance=MAX_DIST, seed=LAYER_SEED)


def clipping_table(query_pos: int = 5, max_k: int = 4, length: int = 10) -> str:
    lines = [f"Query position: {query_pos}", f"Maximum relative distance (k): {max_k}", "",
             "Position | Raw Offset | Clipped Offset", "-" * 42]
    for j in range(length):
        clipped = ref.clip_relative_position(j, query_pos, max_k)
        lines.append(f"{j:^9}|{j - query_pos:^+12}|{clipped:^+14}".rstrip())
    return "\n".join(lines)


def example_report(x: np.ndarray, layer: ref.RelativeSelfAttention) -> tuple[str, np.ndarray, np.ndarray]:
    out, weights = layer.forward(x)
    lines = ["Relative Self-Attention Test", "=" * 45,
             f"Sequence length: {SEQ_LEN}", f"Embedding dim:   {EMBED_DIM}", f"Q/K dimension:   {D_K}",
             f"V dimension:     {D_V}", f"Max distance:    {MAX_DIST}", "",
             f"Input shape:     {x.shape}", f"Output shape:    {out.shape}", f"Weights shape:   {weights.shape}",
             "", "Attention weights (rows sum to 1):", str(np.round(weights, 3))]
    return "\n".join(lines), out, weights


def torch_versions(x: np.ndarray, layer: ref.RelativeSelfAttention) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The example through ``relative_attention`` and ``RelativeMultiheadAttention`` (float64)."""
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    xt = t(x)
    q, k, v = ((xt @ t(w))[None, None] for w in (layer.W_q, layer.W_k, layer.W_v))
    a_k, a_v = t(layer.rel_embed.a_K), t(layer.rel_embed.a_V)
    op_out = relative_attention(q, k, v, a_k, a_v, max_relative_position=MAX_DIST)
    op_w = relative_attention_weights(q, k, a_k, max_relative_position=MAX_DIST)

    # The spec's layer is one head of width 4 on 8-dim inputs with no output projection. The module's
    # heads are embed_dim / num_heads = 4 wide, so both of its two heads carry the spec's projections
    # and the output projection keeps head 0: its output and its head-averaged weights are the spec's.
    mha = RelativeMultiheadAttention(EMBED_DIM, 2, MAX_DIST, bias=False, dtype=torch.float64)
    with torch.no_grad():
        for proj, w in ((mha.q_proj, layer.W_q), (mha.k_proj, layer.W_k), (mha.v_proj, layer.W_v)):
            proj.weight.copy_(torch.cat([t(w).T, t(w).T]))
        mha.out_proj.weight.zero_()
        mha.out_proj.weight[:D_V, :D_V] = torch.eye(D_V, dtype=torch.float64)
        mha.rel_k.copy_(a_k)
        mha.rel_v.copy_(a_v)
        mod_out, mod_w = mha(xt[None], need_weights=True)
    return {
        "relative_attention": (op_out[0, 0].detach().numpy(), op_w[0, 0].detach().numpy()),
        "RelativeMultiheadAttention": (mod_out[0, :, :D_V].numpy(), mod_w[0].numpy()),
    }


def _heatmap(matrix, title, xlabel, ylabel, path, *, yticks=None, annotate=False, cmap="RdBu_r"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    lim = np.abs(matrix).max() if cmap == "RdBu_r" else None
    im = ax.imshow(matrix, cmap=cmap, vmin=-lim if lim else None, vmax=lim)
    fig.colorbar(im, ax=ax)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if yticks is not None:
        ax.set_yticks(range(len(yticks)), yticks)
    if annotate:
        for (i, j), val in np.ndenumerate(matrix):
            r, g, b, _ = im.cmap(im.norm(val))
            ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"  # readable on any cell
            ax.text(j, i, f"{val:g}" if float(val).is_integer() else f"{val:.2f}", ha="center", va="center",
                    fontsize=7, color=ink)
    return save_figure(fig, path)


def run_demo(out_dir: Path) -> list[Path]:
    """Print the walkthrough and save its three heatmaps in ``out_dir`` (checked first:
    :class:`~relattn._io.OutputPathError` if it cannot be a folder)."""
    out_dir = check_output_dir(out_dir)
    print("== 1. Clipping relative positions (spec: query position 5, k = 4, ten positions)\n")
    print(clipping_table() + "\n")

    print("== 2. The clipped relative-position matrix, 10 tokens, k = 4: clip(j - i, -4, 4)\n")
    offsets = relative_position_index(10, 10, 4).numpy() - 4
    print(f"{offsets}\n")

    print("== 3. The spec's example (length 6, embedding 8, d_k = d_v = 4, k = 3, seeds 42 and 123)\n")
    x, layer = spec_example()
    text, out, weights = example_report(x, layer)
    print(text + "\n")

    print("== 4. The same example through the PyTorch op and module (float64)\n")
    for name, (t_out, t_w) in torch_versions(x, layer).items():
        print(f"{name:27s} max |output - reference| = {np.abs(t_out - out).max():.2e}   "
              f"max |weights - reference| = {np.abs(t_w - weights).max():.2e}")
    print()

    print("== 5. Heatmaps")
    paths = [
        _heatmap(offsets, "Clipped relative positions, 10 tokens, k = 4", "key position j", "query position i",
                 out_dir / "clipped_positions_k4.png", annotate=True),
        _heatmap(layer.rel_embed.a_K, "Key-side table a^K at initialisation, k = 3", "embedding dimension",
                 "relative offset", out_dir / "key_table_k3.png", yticks=[f"{r:+d}" for r in range(-3, 4)]),
        _heatmap(weights, "Attention weights of the spec's example", "key position j", "query position i",
                 out_dir / "attention_weights.png", annotate=True, cmap="viridis"),
    ]
    for p in paths:
        print(f"saved {p}")
    return paths


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the spec's walkthrough: clipping, the worked example, heatmaps")
    p.add_argument("--out", default="relattn-demo", help="folder for the PNG heatmaps (default: %(default)s)")
    p.set_defaults(func=lambda args: (run_demo(Path(args.out)), 0)[1])
