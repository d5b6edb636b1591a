"""Per-token log-probs of completions: chunked from hidden states == log_softmax of full logits
(values and LoRA gradients), padding-invariant, KL zero at the start, aligned with the decode path."""

from __future__ import annotations

import pytest
import torch

from kestrel.config import LoraSettings
from kestrel.decode.generate import Generator
from kestrel.training.grpo.logprobs import PAD, completion_logprobs, pack_rows
from kestrel.training.grpo.loss import policy_loss
from kestrel.training.grpo.trainer import split_rows
from kestrel.model.loader import load
from kestrel.model.lora import attach_lora


def _policy(model_dir: str, randomise: bool = True, seed: int = 0):
    model, tok = load(model_dir, 128, dtype="fp32", device="cpu")  # the math, in fp32, on any machine
    for p in model.parameters():
        p.requires_grad_(False)
    model = attach_lora(model, LoraSettings(r=4, alpha=8))
    if randomise:  # a fresh adapter is the identity (B = 0); give it something to say
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model, tok


def _rows(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 7), (3, 1), (9, 4), (2, 6)]  # (prompt, completion) lengths, ragged on purpose
    prompts = [torch.randint(4, vocab, (p,), generator=g).tolist() for p, _ in shapes]
    completions = [torch.randint(4, vocab, (c,), generator=g).tolist() for _, c in shapes]
    return prompts, completions


def _full_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """Reference: one row alone, full (T, V) logits from the causal LM, log_softmax, gather."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float()  # (T, V), softcap applied by the model
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[positions, torch.tensor(completion)]  # (C,)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gemma3 image-text"])
def test_chunked_logprobs_equal_full_logprobs_and_gradients(family: str, tiny_model_dir, demo_tokenizer, tmp_path) -> None:
    """An image-text model (Gemma 3 4B+'s shape): its language model's stack and final softcap."""
    if family.endswith("image-text"):
        from tests.support.tiny_image_text import tiny_image_text_model

        tiny_image_text_model(family.split()[0], len(demo_tokenizer), seed=3).save_pretrained(tmp_path)
        demo_tokenizer.save_pretrained(tmp_path)
        folder = tmp_path
    else:
        folder = tiny_model_dir(family)
    model, tok = _policy(str(folder))
    prompts, completions = _rows(len(tok))
    ids, starts, targets = pack_rows(prompts, completions, tok.pad_token_id, torch.device("cpu"))
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1))
    got = completion_logprobs(model, ids, starts, targets, temperature=0.7)  # (R, L)
    assert got.shape == targets.shape and got.dtype == torch.float32
    assert got[targets == PAD].abs().max() == 0
    (got * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    want_total = 0.0
    for r, (p, c) in enumerate(zip(prompts, completions)):
        want = _full_logprobs(model, p, c, 0.7)
        torch.testing.assert_close(got[r, : len(c)], want.detach(), rtol=1e-5, atol=1e-5)
        want_total = want_total + (want * weights[r, : len(c)]).sum()
    want_total.backward()
    # fp32 sums in another order: 1e-4 of the scale; 2e-4 where the reference is HF's own stack
    # forward (an image-text model's, with its mask mapping) rather than the patched one.
    tol = 2e-4 if family.endswith("image-text") else 1e-4
    for name, grad in grads.items():
        want_grad = model.get_parameter(name).grad
        torch.testing.assert_close(grad, want_grad, rtol=tol, atol=tol * float(want_grad.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert any(g.abs().max() > 0 for g in grads.values())


def test_kl_is_zero_when_policy_equals_reference(tiny_model_dir) -> None:
    """A fresh adapter (B = 0): the policy is the reference, so k3 KL and the first loss are 0."""
    model, tok = _policy(str(tiny_model_dir("qwen3")), randomise=False)
    prompts, completions = _rows(len(tok), seed=2)
    ids, starts, targets = pack_rows(prompts, completions, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad(), model.disable_adapter():
        ref = completion_logprobs(model, ids, starts, targets)
    logp = completion_logprobs(model, ids, starts, targets)
    torch.testing.assert_close(logp.detach(), ref, rtol=1e-6, atol=1e-6)
    zero_adv = torch.zeros(len(prompts))
    loss, stats = policy_loss(logp, logp.detach(), ref, zero_adv, targets != PAD, "grpo", 0.2, 0.04)
    assert abs(float(stats["kl_sum"])) < 1e-9 and abs(float(loss.detach())) < 1e-9
    model2, _ = _policy(str(tiny_model_dir("qwen3")), randomise=True)
    logp2 = completion_logprobs(model2, ids, starts, targets)
    _, stats2 = policy_loss(logp2, logp2.detach(), ref, zero_adv, targets != PAD, "grpo", 0.2, 0.04)
    assert float(stats2["kl_sum"]) > 1e-3  # a trained adapter moves away from the reference


def test_greedy_rollouts_pick_the_argmax_of_the_training_logprobs(tiny_model_dir) -> None:
    """The decode path (LoRA unmerged) and the training forward agree token by token."""
    model, tok = _policy(str(tiny_model_dir("llama")), seed=3)
    prompts, _ = _rows(len(tok), seed=4)
    gen = Generator(model, tok, max_seq_len=64, stop_ids=[])
    out = gen.generate(prompts, max_new_tokens=6, adapter="default")
    ids, starts, targets = pack_rows(prompts, out.tokens, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        chosen = completion_logprobs(model, ids, starts, targets)
        for r, (p, c) in enumerate(zip(prompts, out.tokens)):
            logits = model(input_ids=ids[r : r + 1, : len(p) + len(c)]).logits[0]
            best = torch.log_softmax(logits.float(), -1).max(-1).values[len(p) - 1 : len(p) + len(c) - 1]
            torch.testing.assert_close(chosen[r, : len(c)], best, rtol=1e-5, atol=1e-5)


def test_pack_rows_layout() -> None:
    ids, starts, targets = pack_rows([[1, 2], [3]], [[7, 8, 9], [6]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 7, 8, 9], [3, 6, 0, 0, 0]]
    assert starts.tolist() == [2, 1]
    assert targets.tolist() == [[7, 8, 9], [6, PAD, PAD]]


@pytest.mark.parametrize("widths, budget, expected", [
    ([10, 10, 10, 10], 25, [(0, 2), (2, 4)]),
    ([10, 30, 10], 25, [(0, 1), (1, 2), (2, 3)]),  # a row wider than the budget runs alone
    ([5, 5, 20, 5], 40, [(0, 2), (2, 4)]),  # padded size counts: 3 rows of width 20 would be 60
    ([4], 1, [(0, 1)]),
])
def test_split_rows_respects_the_token_budget(widths, budget, expected) -> None:
    assert [(s.start, s.stop) for s in split_rows(widths, budget)] == expected
