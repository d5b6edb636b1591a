"""The GGUF check's classification of positions where llama.cpp's top-1 token differs from the
reference's: a logit near-tie, a router near-tie (mixtures of experts), or a real difference.
llama.cpp itself is replaced by given logits here; tests/export/test_export_gguf.py runs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kestrel.export import check
from kestrel.export.check import ReferenceRun, check_gguf, experts_per_token, greedy, route_margins
from tests.support.tiny import tiny_model


def test_route_margin_is_the_closest_top_k_boundary_over_layers() -> None:
    # Two tokens, four experts, top-2. Layer 0: token 0's 2nd and 3rd scores 0.01 apart; layer 1: token 1's 0.5 apart.
    layer0 = torch.tensor([[3.0, 2.0, 1.99, -1.0], [3.0, 2.0, 0.0, -1.0]])
    layer1 = torch.tensor([[0.0, 1.0, 4.0, -2.0], [1.0, 1.5, 2.0, 0.0]])
    got = route_margins((layer0, layer1), k=2)
    std0, std1 = layer0.std(-1), layer1.std(-1)
    expected = torch.stack([torch.stack([0.01 / std0[0], 2.0 / std0[1]]),
                            torch.stack([1.0 / std1[0], 0.5 / std1[1]])]).amin(0)
    assert torch.allclose(got, expected, rtol=1e-4)
    assert got[0] < 0.01 < got[1]  # token 0 came close to another expert set, token 1 did not


def _reference(route: np.ndarray | None) -> ReferenceRun:
    """A prompt of 4 tokens (3 evaluated positions) and 3 generated: 6 positions, vocabulary 5,
    token 0 the reference's top-1 everywhere by 4.0, except position 1 (by 0.001: a logit tie)."""
    logits = np.zeros((6, 5), np.float32)
    logits[:, 0] = 4.0
    logits[1, 2] = 3.999
    return ReferenceRun([1, 2, 3, 4], [0, 0, 0], logits, route_margin=route)


def _llama_cpp_says(monkeypatch: pytest.MonkeyPatch, tops: dict[int, int]) -> None:
    """llama.cpp's logits: the reference's top-1 (token 0) everywhere but at `tops` {position: token}."""
    def evaluate(stage, fn, path, seqs, n_ctx, n_prompt):
        scores = []
        for _ in seqs:
            ours = np.zeros((6, 5), np.float32)
            ours[:, 0] = 1.0
            for pos, token in tops.items():
                ours[pos, token] = 2.0
            scores.append(ours)
        return scores, "sample"
    monkeypatch.setattr(check, "run_in_child", evaluate)


def test_differences_are_ties_routing_ties_or_failures(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # Position 1 a logit tie (prompt); 2 (prompt) and 4 (generated) where a router was near a tie; 5 a real difference.
    route = np.array([1.0, 1.0, 0.005, 1.0, 0.01, 0.5], np.float32)
    _llama_cpp_says(monkeypatch, {1: 2, 2: 3, 4: 1, 5: 4})
    got = check_gguf(tmp_path / "m.gguf", [_reference(route)], exact=True, tie_tol=0.02)
    assert (got.prompt_ties, got.prompt_route_ties, got.prompt_beyond_ties) == (1, 1, 0)
    assert (got.ties, got.route_ties) == (0, 1)
    assert not got.passed and len(got.problems) == 1 and "token 2 differs" in got.problems[0]
    # A dense model has no router margins: the same routed positions are real differences.
    dense = check_gguf(tmp_path / "m.gguf", [_reference(None)], exact=True, tie_tol=0.02)
    assert (dense.prompt_route_ties, dense.prompt_beyond_ties, dense.route_ties) == (0, 1, 0)
    assert len(dense.problems) == 2


def test_routing_ties_alone_pass(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    route = np.array([1.0, 1.0, 1.0, 1.0, 0.01, 1.0], np.float32)
    _llama_cpp_says(monkeypatch, {4: 1})
    got = check_gguf(tmp_path / "m.gguf", [_reference(route)], exact=True, tie_tol=0.02)
    assert got.passed and got.route_ties == 1 and not got.greedy_identical


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama"])
def test_reference_runs_record_router_margins_of_mixtures(family: str) -> None:
    model = tiny_model(family, 64, seed=0).float().eval()
    with torch.no_grad():
        run = greedy(model, [1, 5, 9, 13, 17], n_new=4)
    assert run.logits.shape == (5 + 4 - 1, 64)
    if experts_per_token(model) is None:
        assert family == "llama" and run.route_margin is None
        return
    # One margin per evaluated position, each the min over layers of the routers' own margins.
    assert run.route_margin.shape == (run.logits.shape[0],) and (run.route_margin >= 0).all()
    with torch.no_grad():
        out = model(torch.tensor([run.prompt_ids + run.tokens[:-1]]), output_router_logits=True)
    k = experts_per_token(model)
    assert np.allclose(run.route_margin, route_margins(out.router_logits, k).numpy(), rtol=1e-3, atol=1e-4)
