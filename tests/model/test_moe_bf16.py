"""Mixture-of-experts in bf16 on CPU, against an fp32 run of the same (bf16-rounded) weights.

The patched sparse block and the whole patched model may not be much further from the fp32 run
than HF's own bf16 ones are. Both bf16 runs route as the fp32 run does (`tests.support.routing`
says why: unpinned, a few near-tie tokens flip to other experts, and which run flips where decides
the comparison). Also the pin itself: the given experts, the family's own scoring.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kestrel.model.patching import patch_lora_layers, patch_model
from kestrel.model.registry import family_of
from tests.model.test_model_forward import _base
from tests.model.test_moe import MOE, VOCAB, _lora
from tests.support.bf16_runs import packed_batch, padded_batch, pin_to_truth, rel_err, rel_fro, run_with_grads
from tests.support.routing import pin_router, routers
from tests.support.tiny import tiny_model

# HF's gpt-oss stack lets packed samples see each other (tests/model/test_model_forward.py), so
# gpt-oss gets the padded batch only. Qwen3.5-MoE's whole model is left to the block test: HF's
# bf16 linear attention there runs fla's kernels, which need CUDA.
MODEL_CASES = [("qwen3_moe", "packed"), ("qwen3_moe", "padded"), ("gpt_oss", "padded")]


def _twins(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(fp32 truth, HF bf16, patched bf16) of a bf16 model with LoRA."""
    truth = copy.deepcopy(model).float()
    fast = copy.deepcopy(model)
    patch_model(fast)
    assert patch_lora_layers(fast) > 0
    return truth, model, fast


def _first_block(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the first sparse block of `model`, its router)."""
    moe = family_of(model.config.model_type).moe
    block = next(m for m in model.modules() if type(m).__name__ == moe.block_class)
    return block, getattr(block, moe.router_attr)


def _block_run(block: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """One sparse block's output, input gradient and LoRA gradients under dy, all fp32."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out  # gpt-oss's block also returns its router scores
    out.backward(dy.to(out.dtype))
    grads = {n: p.grad.float() for n, p in block.named_parameters() if p.grad is not None}
    return {"out": out.detach().float(), "dx": x.grad.float(), **grads}


@pytest.mark.parametrize("family", MOE)
def test_pinned_router_takes_the_given_experts_and_keeps_its_scoring(family: str) -> None:
    router = routers(tiny_model(family, VOCAB, seed=3))[0]
    x = torch.randn(32, router.weight.shape[1], generator=torch.Generator().manual_seed(0))
    logits, weights, index = router(x)
    own, moved = copy.deepcopy(router), copy.deepcopy(router)
    pin_router(own, index)
    for got, want in zip(own(x), (logits, weights, index)):
        assert torch.equal(got, want)  # pinned to its own choice: exactly its own output
    other = (index + 1) % router.num_experts  # every token's choice moved
    pin_router(moved, other)
    got_logits, got_weights, got_index = moved(x)
    assert torch.equal(got_index, other) and torch.equal(got_logits, logits)
    # Every family's weights are a softmax over the chosen experts' logits (softmax then
    # renormalise, or softmax of the top-k logits): they sum to 1 and w_a / w_b = exp(l_a - l_b).
    chosen = logits.gather(-1, other)
    torch.testing.assert_close(got_weights.sum(-1), torch.ones(32))
    torch.testing.assert_close(got_weights[:, 0] / got_weights[:, 1], torch.exp(chosen[:, 0] - chosen[:, 1]))
    with pytest.raises(ValueError, match="same batch"):
        moved(x[:5])


@pytest.mark.parametrize("family", MOE)
def test_patched_sparse_block_in_bf16_is_as_close_to_fp32_as_hf(family: str) -> None:
    (truth, router), (hf, hf_router), (fast, fast_router) = map(_first_block, _twins(_lora(
        tiny_model(family, VOCAB, seed=21).to(torch.bfloat16), seed=22)))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 256, router.weight.shape[1], generator=g).to(torch.bfloat16)  # (B, T, H)
    dy = torch.randn(x.shape, generator=g)
    index = router(x.float().reshape(-1, x.shape[-1]))[2]  # the fp32 block's routing, for all three
    pin_router(hf_router, index)
    pin_router(fast_router, index)
    want = _block_run(truth, x.float(), dy)
    got_hf, got_fast = _block_run(hf, x, dy), _block_run(fast, x, dy)
    assert got_fast.keys() == want.keys()
    for name, truth_value in want.items():
        hf_err, fast_err = rel_fro(got_hf[name], truth_value), rel_fro(got_fast[name], truth_value)
        assert hf_err < 1e-2, name  # rounding-sized (seeds 21-30: at most 0.007), as the routing is the same
        # Seeds 21-30: at most 1.11 on the experts (LoRA kept as factors rounds a few more
        # intermediates than PEFT's merged weight), 1.23 on Qwen3.5's shared expert (fused LoRA).
        assert fast_err <= 1.35 * hf_err, name


@pytest.mark.parametrize("family,layout", MODEL_CASES)
def test_patched_moe_model_in_bf16_is_as_close_to_fp32_as_hf(family: str, layout: str) -> None:
    truth, hf, fast = _twins(_lora(_base(family, seed=21).to(torch.bfloat16), seed=22).train())
    batch = padded_batch() if layout == "padded" else packed_batch(long_row=False)
    pin_to_truth(truth, [hf, fast], batch)
    want_logits, want_loss, want_grads = run_with_grads(truth, batch)
    hf_logits, hf_loss, hf_grads = run_with_grads(hf, batch)
    fast_logits, fast_loss, fast_grads = run_with_grads(fast, batch)
    keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()  # pad rows are nobody's business
    want_logits, hf_logits, fast_logits = want_logits[keep], hf_logits[keep], fast_logits[keep]
    hf_err = rel_err(hf_logits, want_logits)
    assert hf_err < 3e-2  # rounding-sized (about 0.01); one flipped expert alone gives 0.04 or more
    assert rel_err(fast_logits, want_logits) <= 2 * hf_err + 1e-2
    assert abs(float(fast_loss - want_loss)) <= 2 * abs(float(hf_loss - want_loss)) + 1e-2
    assert fast_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert rel_err(fast_grads[name], want) <= 2 * rel_err(hf_grads[name], want) + 2e-2, name
