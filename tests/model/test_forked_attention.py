"""Forked samples (`kestrel.model.attention.ForkedSamples`): groups [prefix, branch 1, ..., branch k]
in one flattened row attend with keys of their own, so each branch sees the prefix and itself and
never another branch. Checked against each (prefix + branch) sequence alone through SDPA, outputs
and gradients, causal and windowed; the reference's bottom-right alignment of short query samples."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.model import attention as attn
from kestrel.model.decoder_stack import attention_inputs
from tests.support.tiny import tiny_model

GROUPS = [(4, [3, 5]), (1, [2, 1]), (6, [2, 4, 3])]  # (prefix, branches): ragged, one of three branches


def _alone(q, k, v, start: int, prefix: int, branch: tuple[int, int], window: tuple[int, int]) -> torch.Tensor:
    """(branch length, Hq, D): the branch's queries over the sequence [prefix, branch] alone."""
    rows = list(range(start, start + prefix)) + list(range(*branch))
    q4, k4, v4 = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, L, D)
    mask = attn.window_mask(len(rows), len(rows), window, q.device)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=0.4, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)[prefix:]


@pytest.mark.parametrize("window", [(-1, 0), (2, 0)], ids=["causal", "window3"])
@pytest.mark.parametrize("padded", [False, True], ids=["real", "rounded"])
def test_each_branch_sees_its_prefix_and_itself(window: tuple[int, int], padded: bool) -> None:
    real = sum(p + sum(b) for p, b in GROUPS)
    keys = real + sum(p * (len(b) - 1) for p, b in GROUPS)
    width, key_width = (real + 3, keys + 3 + 5) if padded else (real, keys)
    fork = attn.fork_layout(GROUPS, width, key_width, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, width, 8, generator=g, requires_grad=True)  # (B, Hq, T, D)
    k, v = (torch.randn(1, 2, width, 8, generator=g, requires_grad=True) for _ in range(2))  # (B, Hkv, T, D)
    call = attn.VarlenCall(fork.queries, window, attn.reference_varlen_attn, fork.keys)
    got = attn.varlen_attention(q, k, v, call, scale=0.4).view(width, 4, 8)  # (T, Hq, D)
    flat = [x[0].transpose(0, 1) for x in (q, k, v)]  # (T, H, D)
    want = got.detach().clone()
    at = 0
    for prefix, branches in GROUPS:
        start = at + prefix
        for length in branches:
            want[start : start + length] = _alone(*flat, at, prefix, (start, start + length), window)
            start += length
        want[at : at + prefix] = _alone(*flat, at, 0, (at, at + prefix), window)
        at = start
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weight = torch.randn(got.shape, generator=g)
    weight[real:] = 0  # the padding's outputs feed nothing
    grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
    want_weighted = torch.zeros(())
    at = 0
    for prefix, branches in GROUPS:  # the same loss, every piece computed alone
        start = at + prefix
        want_weighted = want_weighted + (_alone(*flat, at, 0, (at, start), window) * weight[at:start]).sum()
        for length in branches:
            piece = _alone(*flat, at, prefix, (start, start + length), window)
            want_weighted = want_weighted + (piece * weight[start : start + length]).sum()
            start += length
        at = start
    for a, b in zip(grads, torch.autograd.grad(want_weighted, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fork_layout_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="padding tail"):
        attn.fork_layout([(2, [1, 1])], 4, 8, torch.device("cpu"))  # two spare keys and no tail to hold them
    with pytest.raises(ValueError, match="prefix"):
        attn.fork_layout([(0, [1, 1])], 2, 2, torch.device("cpu"))


def test_reference_aligns_short_query_samples_bottom_right() -> None:
    mask = attn.window_mask(2, 5, (-1, 0), torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert attn.window_mask(2, 5, (1, 0), torch.device("cpu")).tolist() == [[False, False, True, True, False],
                                                                              [False, False, False, True, True]]
    q, k = torch.zeros(5, 1, 4), torch.zeros(3, 1, 4)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="bottom-right"):
        attn.reference_varlen_attn(q, k, k, cu_q, cu_k, 5, 3, window_size=(-1, 0))


def test_attention_inputs_take_the_callers_fork() -> None:
    model = tiny_model("gemma3_text", 64, sliding_window=4, layer_types=["sliding_attention", "full_attention"]).model
    fork = attn.fork_layout([(3, [2, 2])], 8, 12, torch.device("cpu"))
    embeds = torch.zeros(1, 8, 128)
    out = attention_inputs(model, "reference", [4, None], embeds, None, None, forked=fork)
    assert all(mask is None and call.keys is fork.keys and call.samples is fork.queries for mask, call in out.values())
    assert out[4][1].window == (3, 0)
    with pytest.raises(ValueError, match="varlen kernel"):
        attention_inputs(model, "off", [4, None], embeds, None, None, forked=fork)
