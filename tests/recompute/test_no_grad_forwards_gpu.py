"""On CUDA, a DPO reference pass of a layout the run graphs replays each layer's first-pass graph
of the adapter-disabled signature (`kestrel.recompute.no_grad`), and its log-probs equal the same
pass run eagerly; the policy's loss and gradients are unchanged by it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kestrel.config import LoraSettings, config_from_dict
from kestrel.model.loader import load
from kestrel.model.lora import attach_lora
from kestrel.recompute.checkpoint import set_gradient_checkpointing
from kestrel.training.preference import score
from kestrel.training.preference.reference import adapter_layers, as_reference
from kestrel.training.preference.rows import answer_logprobs
from tests.support.bf16_runs import rel_err
from tests.training.test_preference_shared import _samples

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["standard", "offload"])
def test_reference_pass_replays_graphs_and_scores_as_eager(tiny_model_dir, mode: str) -> None:
    model, tok = load(str(tiny_model_dir("llama")), 128, dtype="bf16", device="cuda")
    for p in model.parameters():
        p.requires_grad_(False)
    model = attach_lora(model, LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    recompute = set_gradient_checkpointing(model, mode, cuda_graphs="on")
    model.train()
    cfg = config_from_dict({"model": "demo", "method": "dpo", "preference": {"beta": 0.1}})
    s = SimpleNamespace(config=cfg, model=model, pad_id=0, device=torch.device("cuda"), flat=True, share_prompt=True,
                        adapter_layers=adapter_layers(model), recompute=recompute)
    samples = _samples(len(tok))
    idx = list(range(len(samples)))
    losses = []
    for _ in range(4):  # sightings: eager, backward captured, then the reference's first pass captured
        stats = score.StepStats(torch.zeros((), device="cuda"))
        loss = score.micro_loss(s, score.RowSet(samples), idx, stats)
        loss.backward()
        losses.append(loss.detach())
        model.zero_grad(set_to_none=True)
    forwards_before = recompute.graphs.stats()["forward"]
    rows = score.scored_rows(s, samples)
    with as_reference(model, s.adapter_layers, recompute):
        graphed = answer_logprobs(model, rows)
        assert recompute.no_grad_graphed
    assert recompute.graphs.stats()["forward"] == forwards_before  # replayed, none captured anew
    assert forwards_before >= 2 * model.config.num_hidden_layers  # the policy's and the reference's
    with as_reference(model, s.adapter_layers):
        eager = answer_logprobs(model, rows)
    assert graphed.isfinite().all() and rel_err(graphed, eager) <= 1e-3
    assert all(torch.allclose(x, losses[0], rtol=2e-2, atol=2e-3) for x in losses)  # no update between
