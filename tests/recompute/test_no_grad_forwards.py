"""A reference pass (`as_reference` with the run's `Recompute`) routes each decoder layer's
no-grad call through the recompute (`kestrel.recompute.no_grad`), where a graphed layout replays
first-pass graphs on CUDA. On the CPU the calls run eagerly: the test checks the routing, that
every submodule stays in eval mode meanwhile, that the log-probs equal the plain reference pass's
exactly, and that every flag is restored."""

from __future__ import annotations

import pytest
import torch

from kestrel.model.patching import PatchFlags
from kestrel.recompute import no_grad
from kestrel.recompute.checkpoint import set_gradient_checkpointing
from kestrel.training.preference.reference import adapter_layers, as_reference
from kestrel.training.preference.rows import answer_logprobs, shared_answer_rows
from tests.training.test_preference_rows import _model
from tests.training.test_preference_shared import _samples


@pytest.mark.parametrize("mode,graphs", [("standard", "off"), ("offload", "off"), ("standard", "on")])
def test_a_reference_pass_goes_through_the_recompute_in_eval_mode(tiny_model_dir, monkeypatch, mode: str, graphs: str) -> None:
    model, tok = _model(str(tiny_model_dir("llama")), lora=True, patch=PatchFlags(varlen="reference"))
    recompute = set_gradient_checkpointing(model, mode, cuda_graphs=graphs)
    assert recompute is not None
    model.train()
    layers, decoder = adapter_layers(model), recompute.layers()
    rows = shared_answer_rows([(x.prompt, x.answers) for x in _samples(len(tok))], 0, torch.device("cpu"))
    seen: list[tuple[bool, bool]] = []
    widths: list[int] = []
    real_call = no_grad.call

    def spy(rc, run, hidden, args):
        layer = run.func.__self__
        seen.append((layer.training, any(m.training for m in layer.children())))
        widths.append(hidden.shape[-2])
        return real_call(rc, run, hidden, args)

    monkeypatch.setattr(no_grad, "call", spy)
    with as_reference(model, layers):  # the plain pass: eval mode, no checkpoint function called
        want = answer_logprobs(model, rows)
    assert not seen
    with as_reference(model, layers, recompute):
        got = answer_logprobs(model, rows)
        assert recompute.no_grad_active and not recompute.no_grad_graphed  # the CPU has no graphs
    assert len(seen) == len(decoder) == model.config.num_hidden_layers
    assert all(layer_on and not children_on for layer_on, children_on in seen)  # submodules stay in eval mode
    # A run that graphs takes the training forward's rounded width (its graphs' shapes), else the real columns
    assert set(widths) == {rows.input_ids.shape[1] if graphs == "on" else rows.used}
    assert rows.input_ids.shape[1] > rows.used  # the two differ here
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not recompute.no_grad_active and model.training and all(layer.training for layer in decoder)
    assert all(not layer.disable_adapters for layer in layers)
    model.eval()
    with as_reference(model, layers, recompute):
        answer_logprobs(model, rows)
    assert not any(layer.training for layer in decoder)  # eval before, eval after

