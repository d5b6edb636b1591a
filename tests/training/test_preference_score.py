"""One DPO micro-batch (`score.micro_loss`): the reference pass runs first, with no gradient, on the
very rows the policy then scores, and the loss is DPO's on the two passes' log-probs; the
reference switch (`as_reference`) flips the adapter layers found once and restores them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kestrel.config import config_from_dict
from kestrel.data.preference_tokens import PreferenceSample
from kestrel.training.preference import loss as L
from kestrel.training.preference import score
from kestrel.training.preference.reference import adapter_layers, as_reference
from kestrel.training.preference.rows import answer_logprobs, answer_rows
from tests.training.test_preference_rows import _model, _pairs


def test_reference_first_on_the_same_rows_then_the_policy(tiny_model_dir, monkeypatch, one_thread) -> None:
    model, tok = _model(str(tiny_model_dir("llama")), lora=True)
    pairs = _pairs(len(tok))
    samples = [PreferenceSample(prompt=p, answers=[a, pairs[(i + 1) % len(pairs)][1]]) for i, (p, a) in enumerate(pairs)]
    cfg = config_from_dict({"model": "demo", "method": "dpo", "preference": {"beta": 0.1, "loss_type": "sigmoid"}})
    s = SimpleNamespace(config=cfg, model=model, pad_id=tok.pad_token_id, device=torch.device("cpu"), flat=False,
                        share_prompt=False, adapter_layers=adapter_layers(model))
    calls = []

    def spy(m, rows):
        calls.append((rows, torch.is_grad_enabled(), m.training))
        return answer_logprobs(m, rows)

    monkeypatch.setattr(score, "answer_logprobs", spy)
    idx = [0, 2, 3]
    loss = score.micro_loss(s, score.RowSet(samples), idx, score.StepStats(torch.zeros(())))
    assert [(grad, training) for _, grad, training in calls] == [(False, False), (True, True)]
    assert calls[0][0] is calls[1][0]  # one AnswerRows built for both passes

    rows = answer_rows([(samples[i].prompt, samples[i].answers[k]) for k in (0, 1) for i in idx], s.pad_id, s.device, False)
    with as_reference(model):
        ref = answer_logprobs(model, rows).sum(-1)
    policy = answer_logprobs(model, rows).sum(-1)
    tokens = rows.tokens.float()
    n = len(idx)
    expected = L.dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], 0.1, "sigmoid", tokens[:n], tokens[n:]).loss
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert loss.requires_grad


def test_as_reference_switches_the_given_adapter_layers_without_a_walk_and_restores_them(tiny_model_dir, monkeypatch) -> None:
    model, _ = _model(str(tiny_model_dir("llama")), lora=True)
    layers = adapter_layers(model)  # found once, by the run's setup
    assert layers
    kept_off = layers[0]
    kept_off.enable_adapters(False)  # already disabled: stays so after the context
    # PEFT's context takes the model's adapter status (a walk over every module) each time
    monkeypatch.setattr(type(model), "get_model_status", lambda self: pytest.fail("walked the model"))
    monkeypatch.setattr(type(model), "modules", lambda self: pytest.fail("walked the model"))
    with as_reference(model, layers):
        assert not model.training and not torch.is_grad_enabled()
        assert all(layer.disable_adapters for layer in layers)
        assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    assert model.training
    assert kept_off.disable_adapters and not any(layer.disable_adapters for layer in layers[1:])
    assert all(p.requires_grad for layer in layers[1:] for n, p in layer.named_parameters() if "lora_" in n)
