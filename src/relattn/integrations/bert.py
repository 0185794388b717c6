"""``load_bert_relative_key(path)``: a transformers-4 BERT-family checkpoint with ``relative_key`` or
``relative_key_query`` positions as a transformers-5 model computing what transformers 4 computed, on relattn.

transformers 5 removed these position types (PR #41170); v5 BERT always adds absolute position embeddings and has
no ``distance_embedding``. transformers 4 computed, per head (``D`` head dim, ``P`` max_position_embeddings,
``a_ij = distance_embedding[(i - j) + P - 1]``, a table of ``2P - 1`` rows shared by the heads)::

    relative_key:        s_ij = (q_i . k_j + q_i . a_ij) / sqrt(D)
    relative_key_query:  s_ij = (q_i . k_j + q_i . a_ij + k_j . a_ij) / sqrt(D)

and no absolute position embeddings. In relattn's offsets ``j - i`` the table is flipped, ``K = P - 1``, and the
``k_j . a_ij`` term is the op's position-to-content table ``rel_q``: the same flipped table, so no (B, H, N, M)
tensor is built where ``auto`` runs the blocked backend.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch
from torch import nn

from ..backends import check_name
from ..functional import relative_attention
from ..padding import merge_heads, packed_self_attention
from .hf_common import as_attn_mask, dropout_p, qkv, right_packing

POSITION_TYPES = ("relative_key", "relative_key_query")
_TABLE = "distance_embedding.weight"
_CONVERT = ("convert it once with transformers 4 installed: AutoModel.from_pretrained(path).save_pretrained(path, "
            "safe_serialization=True), or with torch and safetensors: "
            "python -c \"import torch; from safetensors.torch import save_file; "
            "sd = torch.load('pytorch_model.bin', weights_only=True); "
            "save_file({k: v.contiguous().clone() for k, v in sd.items()}, 'model.safetensors', "
            "metadata={'format': 'pt'})\"")


def _bert_forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
    """A v5 BertSelfAttention (or family) computing the v4 relative_key(_query) attention."""
    if cache is not None:
        raise NotImplementedError("relattn's BERT relative_key attention is encoder-only (no cache)")
    table = self.distance_embedding.weight.flip(0).to(hidden_states.dtype)  # rows (i - j) + K -> rows (j - i) + K
    kk = self.max_position_embeddings - 1
    rel_q = table if self.position_embedding_type == "relative_key_query" else None
    packing = right_packing(attention_mask, hidden_states, self)
    if packing is not None:
        return packed_self_attention(packing, hidden_states, (self.query, self.key, self.value),
                                     self.num_attention_heads, rel_k=table, max_relative_position=kk, rel_q=rel_q,
                                     dropout_p=dropout_p(self, self.dropout.p), scale=self.scaling,
                                     backend=self._relattn_backend), None
    q, k, v = qkv(hidden_states, (self.query, self.key, self.value), self.num_attention_heads)
    out = relative_attention(q, k, v, table, None, max_relative_position=kk, rel_q=rel_q,
                             attn_mask=as_attn_mask(attention_mask),
                             dropout_p=dropout_p(self, self.dropout.p), scale=self.scaling,
                             backend=self._relattn_backend)
    return merge_heads(out), None


def _no_positions(self, position_ids):
    """transformers 4 added no absolute position embeddings to relative_key models: zeros (exact under +)."""
    return self.weight.new_zeros(*position_ids.shape, self.embedding_dim)


def _read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"path must be a checkpoint directory with a config.json; none in {path}")
    config = json.loads(config_file.read_text())
    kind = config.get("position_embedding_type", "absolute")
    if kind not in POSITION_TYPES:
        raise ValueError(f"config.json's position_embedding_type must be one of {POSITION_TYPES}; got {kind!r} "
                         "(absolute checkpoints load with transformers' own from_pretrained)")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise ValueError("decoder BERT checkpoints (is_decoder / add_cross_attention) are not supported: "
                         "load_bert_relative_key serves encoders")
    if not config.get("architectures"):
        raise ValueError(f"config.json in {path} names no architectures; expected e.g. ['BertForMaskedLM']")
    return config


def _read_tables(path: Path) -> dict[str, torch.Tensor]:
    """The distance_embedding tables of the checkpoint's safetensors file(s); a pickle checkpoint is refused."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif pickles := sorted(p.name for p in path.glob("*.bin")):
        raise ValueError(f"{path} holds a pickle checkpoint ({', '.join(pickles)}), which relattn does not load "
                         f"(unpickling runs code); {_CONVERT}")
    else:
        raise FileNotFoundError(f"no model.safetensors in {path}")
    tables = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            tables.update({key: f.get_tensor(key) for key in f.keys() if key.endswith(_TABLE)})
    return tables


def _find_table(tables: dict, name: str, prefix: str) -> torch.Tensor:
    """The table of the self-attention module ``name``, saved with or without the base model's prefix."""
    bare = name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name
    for key in (f"{name}.{_TABLE}", f"{bare}.{_TABLE}", f"{prefix}.{bare}.{_TABLE}"):
        if key in tables:
            return tables[key]
    raise ValueError(f"the checkpoint has no {name}.{_TABLE}; a relative_key checkpoint has one per layer")


def load_bert_relative_key(path: str | Path, *, backend: str = "auto", **from_pretrained_kwargs) -> nn.Module:
    """Load a transformers-4 BERT-family ``relative_key`` / ``relative_key_query`` checkpoint directory.

    Args:
        path: a directory with config.json and model.safetensors (or a sharded model.safetensors.index.json).
            A pickle ``pytorch_model.bin`` is refused, with the command that converts it.
        backend: the relattn backend of every self-attention layer.
        **from_pretrained_kwargs: passed to the model class's ``from_pretrained`` (e.g. ``dtype``).

    Returns:
        A model of the class ``config.json``'s ``architectures[0]`` names (e.g. BertForMaskedLM), whose
        self-attention layers hold ``distance_embedding`` under the names transformers 4 saved it (so
        ``save_pretrained`` writes a checkpoint this function loads again) and compute transformers 4's formula.
    """
    import transformers
    from transformers.utils import logging

    path = Path(path)
    backend = check_name(backend)
    config = _read_config(path)
    tables = _read_tables(path)
    name = config["architectures"][0]
    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"config.json's architectures[0] = {name!r} is not a transformers model class")
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the distance_embedding keys are "unexpected" to v5: we load them below
    try:
        model = cls.from_pretrained(path, **from_pretrained_kwargs)
    finally:
        logging.set_verbosity(verbosity)
    kind, positions = config["position_embedding_type"], config["max_position_embeddings"]
    prefix = getattr(model, "base_model_prefix", "")
    patched = []
    for module_name, module in model.named_modules():
        if type(module).__name__.endswith("SelfAttention") and all(
                isinstance(getattr(module, a, None), nn.Linear) for a in ("query", "key", "value")):
            weight = _find_table(tables, module_name, prefix)
            if weight.shape != (2 * positions - 1, module.attention_head_size):
                raise ValueError(f"{module_name}.{_TABLE} has shape {tuple(weight.shape)}, expected "
                                 f"({2 * positions - 1}, {module.attention_head_size})")
            like = module.query.weight
            module.distance_embedding = nn.Embedding(2 * positions - 1, module.attention_head_size,
                                                     device=like.device, dtype=like.dtype)
            module.distance_embedding.weight.data.copy_(weight)
            module.position_embedding_type, module.max_position_embeddings = kind, positions
            module._relattn_backend = backend
            module.forward = types.MethodType(_bert_forward, module)
            patched.append(module_name)
        elif type(module).__name__.endswith("Embeddings") and isinstance(
                getattr(module, "position_embeddings", None), nn.Embedding):
            module.position_embeddings.forward = types.MethodType(_no_positions, module.position_embeddings)
    if not patched:
        raise ValueError(f"{name} has no BERT-style self-attention (query/key/value) for relative_key positions")
    return model


__all__ = ["POSITION_TYPES", "load_bert_relative_key"]
