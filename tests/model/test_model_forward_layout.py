"""The attention layout on its own: sample boundaries, the dispatch decision, windows, and the
varlen math against one block-diagonal SDPA call (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import masking_utils

from kestrel.model import attention as attn
from kestrel.model.decoder_stack import attention_inputs
from kestrel.model.sink_attention import flash_sink_varlen_attn
from kestrel.model.registry import FAMILIES
from tests.support.tiny import tiny_config, tiny_model

VOCAB = 64


def _positions(*rows: list[int]) -> torch.Tensor:
    """Rows of sample lengths -> (B, T) position ids restarting at 0 for each sample."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def test_samples_from_position_ids() -> None:
    positions = _positions([3, 2, 4], [9])
    starts = attn.sample_starts(positions)
    samples = attn.samples_from_starts(starts, torch.device("cpu"))
    assert samples.cu_seqlens.dtype == torch.int32
    # Padded to a capacity of 16 bounds with empty samples; the longest taken as the row width.
    assert samples.cu_seqlens.tolist() == [0, 3, 5, 9, 18] + [18] * 11 and samples.max_len == 9


def test_sample_starts_follow_hf_rule() -> None:
    """HF starts a sample wherever the position does not step by 1, not only at 0."""
    positions = torch.tensor([[5, 6, 7, 8, 0, 1, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7]])
    starts = attn.sample_starts(positions)
    assert starts.nonzero().tolist() == [[0, 0], [0, 4], [0, 6], [1, 0]]
    hf = masking_utils.find_packed_sequence_indices(positions)  # (B, T) sample index per token
    assert torch.equal(starts[:, 1:], hf[:, 1:] != hf[:, :-1])


def test_row_samples() -> None:
    samples = attn.row_samples(3, 5, torch.device("cpu"))
    assert samples.cu_seqlens.tolist() == [0, 5, 10, 15] and samples.max_len == 5


@pytest.mark.parametrize(
    "padded,packed,window,seq_len,varlen,sinks,expected",
    [
        (False, False, None, 64, True, False, "hf_mask"),  # plain causal: SDPA is_causal
        (False, True, None, 64, True, False, "varlen_samples"),
        (False, True, 16, 64, True, False, "varlen_samples"),
        (False, False, 16, 64, True, False, "varlen_rows"),  # longer than the window
        (False, False, 16, 16, True, False, "hf_mask"),  # within the window: plain causal
        (True, True, 16, 64, True, False, "hf_mask"),  # padding: HF's mask
        (False, True, None, 64, False, False, "hf_mask"),  # no varlen kernel: HF's block mask
        (False, False, None, 64, True, True, "varlen_rows"),  # sinks: HF's path would be eager
        (False, False, 16, 16, True, True, "varlen_rows"),
        (True, False, None, 64, True, True, "hf_mask"),  # left padding, a hole: HF's mask still
        (False, False, None, 64, False, True, "hf_mask"),
    ],
)
def test_plan_layer(
    padded: bool, packed: bool, window: int | None, seq_len: int, varlen: bool, sinks: bool, expected: str
) -> None:
    plan = attn.plan_layer(padded=padded, packed=packed, window=window, seq_len=seq_len, varlen=varlen, sinks=sinks)
    assert plan == expected


def test_varlen_backend_choice() -> None:
    from torch.nn.attention.varlen import varlen_attn

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert attn.varlen_backend("auto", cuda, torch.bfloat16, dropout=False) is varlen_attn
    assert attn.varlen_backend("auto", cuda, torch.float16, dropout=False) is varlen_attn
    assert attn.varlen_backend("auto", cuda, torch.float32, dropout=False) is None
    assert attn.varlen_backend("auto", cpu, torch.bfloat16, dropout=False) is None
    assert attn.varlen_backend("auto", cuda, torch.bfloat16, dropout=True) is None
    assert attn.varlen_backend("off", cuda, torch.bfloat16, dropout=False) is None
    assert attn.varlen_backend("reference", cpu, torch.float32, dropout=False) is attn.reference_varlen_attn
    # attention sinks: the sink function on CUDA, the reference (which takes sinks) elsewhere
    assert attn.varlen_backend("auto", cuda, torch.bfloat16, dropout=False, sinks=True) is flash_sink_varlen_attn
    assert attn.varlen_backend("auto", cpu, torch.bfloat16, dropout=False, sinks=True) is None
    assert attn.varlen_backend("reference", cpu, torch.float32, dropout=False, sinks=True) is attn.reference_varlen_attn


@pytest.mark.parametrize("window", [1, 3, 8])
def test_flash_window_is_hf_sliding_window(window: int) -> None:
    t = 12
    hf = masking_utils.sliding_window_causal_mask_function(window)
    idx = [torch.tensor(n) for n in range(t)]
    expected = torch.tensor([[bool(hf(0, 0, i, j)) for j in idx] for i in idx])
    assert torch.equal(attn.window_mask(t, t, attn.flash_window(window), torch.device("cpu")), expected)
    assert torch.equal(attn.window_mask(t, t, attn.flash_window(None), torch.device("cpu")), torch.ones(t, t).tril().bool())


def test_layer_windows_per_family() -> None:
    def windows(family: str, **overrides: object) -> list[int | None]:
        config = tiny_config(family, VOCAB, num_hidden_layers=3, **overrides)
        return [attn.layer_window(FAMILIES[family], config, i) for i in range(3)]

    assert windows("llama") == [None, None, None]
    assert windows("mistral") == [None, None, None]
    assert windows("mistral", sliding_window=5) == [5, 5, 5]
    assert windows("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1) == [None, 5, 5]
    assert windows("gemma3_text", layer_types=["sliding_attention", "full_attention", "sliding_attention"]) == [16, None, 16]


def _block_mask(cu: list[int], window: tuple[int, int]) -> torch.Tensor:
    """(total, total) bool: same sample, and inside the window."""
    total = cu[-1]
    sample = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    return (sample[:, None] == sample[None, :]) & attn.window_mask(total, total, window, torch.device("cpu"))


@pytest.mark.parametrize("window", [(-1, 0), (2, 0), (6, 0)])
def test_reference_varlen_equals_block_mask_sdpa(window: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    cu = [0, 5, 12, 13, 30]
    q = torch.randn(30, 4, 16, generator=g, requires_grad=True)  # (total, Hq, D)
    k, v = (torch.randn(30, 2, 16, generator=g, requires_grad=True) for _ in range(2))  # (total, Hkv, D)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    got = attn.reference_varlen_attn(q, k, v, cu_t, cu_t, 17, 17, scale=0.3, window_size=window, enable_gqa=True)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, total, D)
    want = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=_block_mask(cu, window), scale=0.3, enable_gqa=True)
    want = want.squeeze(0).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_varlen_attention_without_enable_gqa_repeats_kv() -> None:
    """torch 2.11's varlen_attn has no enable_gqa: K/V heads are repeated as HF's repeat_kv does."""

    def no_gqa(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):  # type: ignore[no-untyped-def]
        assert key.shape[1] == query.shape[1]
        return attn.reference_varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 10, 8, generator=g)  # (B, Hq, T, D)
    k, v = (torch.randn(2, 2, 10, 8, generator=g) for _ in range(2))  # (B, Hkv, T, D)
    samples = attn.samples_from_starts(attn.sample_starts(_positions([4, 6], [10])), torch.device("cpu"))
    outs = [
        attn.varlen_attention(q, k, v, attn.VarlenCall(samples, (3, 0), fn), scale=0.5)
        for fn in (no_gqa, attn.reference_varlen_attn)
    ]
    assert outs[0].shape == (2, 10, 32)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_attention_inputs_per_window() -> None:
    """One layout per window size: varlen for packed and right-padded rows, HF masks for left padding."""
    model = tiny_model("gemma3_text", VOCAB, sliding_window=4, layer_types=["sliding_attention", "full_attention"]).model
    embeds = torch.zeros(2, 10, 128)
    positions = _positions([6, 4], [10])
    packed = attention_inputs(model, "reference", [4, None], embeds, None, positions)
    assert packed.keys() == {4, None}
    assert all(mask is None and call.samples.cu_seqlens.tolist() == [0, 6, 10, 20] + [20] * 12 for mask, call in packed.values())
    assert packed[4][1].window == (3, 0) and packed[None][1].window == (-1, 0)
    right = torch.ones(2, 10, dtype=torch.long)
    right[1, 7:] = 0  # row 1: 7 real tokens, then padding (a segment of its own)
    plain = torch.arange(10).unsqueeze(0)
    padded = attention_inputs(model, "reference", [4, None], embeds, right, plain)
    assert all(mask is None and call.samples.cu_seqlens.tolist() == [0, 10, 17, 20] + [20] * 12 for mask, call in padded.values())
    both = attention_inputs(model, "reference", [4, None], embeds, right, positions)  # packed and padded
    assert all(call.samples.cu_seqlens.tolist() == [0, 6, 10, 17, 20] + [20] * 11 for _, call in both.values())
    left = right.flip(1)  # left padding (or a hole) keeps HF's own masks
    assert all(call is None for _, call in attention_inputs(model, "reference", [4, None], embeds, left, plain).values())
    off = attention_inputs(model, "off", [4, None], embeds, None, positions)
    assert all(call is None and mask.shape == (2, 1, 10, 10) for mask, call in off.values())  # HF's block masks
