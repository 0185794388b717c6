"""BERT ``relative_key_query`` checkpoints (``load_bert_relative_key``) on the position-to-content term: they run on
the blocked backend (no (B, H, N, M) tensor) and give transformers 4's outputs and gradients."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

import relattn.functional as fn  # noqa: E402
from helpers.hf import bert_inputs, bert_out, relative_error, v4_checkpoint, v4_reference  # noqa: E402


def test_relative_key_query_runs_blocked_with_the_table_as_rel_q(tmp_path, monkeypatch):
    from relattn.integrations.bert import load_bert_relative_key

    state = v4_checkpoint(tmp_path / "v4", "relative_key_query", "BertModel")
    model = load_bert_relative_key(tmp_path / "v4", backend="blocked").double().eval()
    calls = []
    resolve = fn.resolve
    monkeypatch.setattr(fn, "resolve", lambda name, call: calls.append(call) or resolve(name, call))
    inputs = bert_inputs()
    want = v4_reference(state, "relative_key_query", "BertModel", *inputs)
    got = bert_out(model, "BertModel", *inputs)
    assert relative_error(got, want) <= 1e-10
    assert len(calls) == 2
    for call in calls:  # the key-query term as the table; the padded batch packed: no mask, no scores in one
        assert call.rel_q is not None and torch.equal(call.rel_q, call.rel_k)
        assert call.mask is None and call.cu_seqlens_q.tolist() == [0, 11, 17]
    cotangent = torch.randn_like(want)
    (want * cotangent).sum().backward()
    (got * cotangent).sum().backward()
    params = dict(model.named_parameters())
    for name in ("encoder.layer.0.attention.self.distance_embedding.weight",
                 "encoder.layer.1.attention.self.key.weight", "encoder.layer.1.attention.self.key.bias"):
        assert relative_error(params[name].grad, state[name].grad) <= 1e-9, name
