"""Answer log-probs of chosen and rejected rows in one batched forward, through the chunked fused
path == each row alone through full (T, V) logits: values and gradients (LoRA, and every weight
with lm_head included), padded and padding-free layouts, fp32."""

from __future__ import annotations

import pytest
import torch

from kestrel.config import LoraSettings
from kestrel.model.attention import STARTS_KWARG
from kestrel.model.loader import load
from kestrel.model.lora import attach_lora
from kestrel.model.patching import PatchFlags
from kestrel.training.preference.reference import as_reference
from kestrel.training.preference.rows import answer_logprobs, answer_rows

SHAPES = [(5, 7), (3, 1), (9, 4), (2, 6), (4, 3)]  # (prompt, answer) lengths, ragged on purpose


def _model(model_dir: str, lora: bool, patch: bool | PatchFlags = True):
    model, tok = load(model_dir, 128, dtype="fp32", device="cpu", patch=patch)
    if lora:
        for p in model.parameters():
            p.requires_grad_(False)
        torch.manual_seed(0)  # lora_A's init draws from the global generator: fix it, not the test order
        model = attach_lora(model, LoraSettings(r=4, alpha=8))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a fresh adapter is the identity (B = 0); give it something to say
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    return model, tok


def _pairs(vocab: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(4, vocab, (p,), generator=g).tolist(), torch.randint(4, vocab, (a,), generator=g).tolist())
            for p, a in SHAPES]


def _full_sequence_logp(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Reference: one row alone, full (T, V) logits, log_softmax, gather, sum over the answer."""
    logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].float()  # (T, V)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
    return torch.log_softmax(logits, dim=-1)[positions, torch.tensor(answer)].sum()


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("flat", [False, True], ids=["padded", "flat"])
def test_batched_answer_logprobs_equal_full_logits(tiny_model_dir, lora: bool, flat: bool) -> None:
    model, tok = _model(str(tiny_model_dir("llama")), lora)
    pairs = _pairs(len(tok))
    weights = torch.randn(len(pairs), generator=torch.Generator().manual_seed(1))  # signed, as DPO's are
    rows = answer_rows(pairs, tok.pad_token_id, torch.device("cpu"), flat)
    logp = answer_logprobs(model, rows)  # (R, L)
    answers = [a for _, a in SHAPES]
    assert logp.shape == (len(pairs), max(answers))
    assert all(logp[r, n:].abs().max() == 0 for r, n in enumerate(answers) if n < max(answers))
    # only real answer tokens go through the LM head: no padding of short answers to the longest
    assert rows.targets.tolist() == [t for _, a in pairs for t in a] and rows.col.shape == (sum(answers),)
    assert rows.tokens.tolist() == answers
    seq = logp.sum(-1)
    (seq * weights).sum().backward()
    fused = _grads(model)
    expected = torch.stack([_full_sequence_logp(model, p, a) for p, a in pairs])
    (expected * weights).sum().backward()
    reference = _grads(model)
    torch.testing.assert_close(seq, expected, rtol=1e-5, atol=1e-5)
    assert fused.keys() == reference.keys() and len(fused) > 0
    if not lora:
        assert any("lm_head" in n or "embed_tokens" in n for n in fused)  # the head's weight gradient too
    for name, grad in reference.items():  # fp32 sums in another order: error relative to the tensor's scale
        scale = grad.abs().max().item()
        torch.testing.assert_close(fused[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_reference_is_the_base_with_the_adapter_disabled(tiny_model_dir) -> None:
    base, tok = load(str(tiny_model_dir("llama")), 128, dtype="fp32", device="cpu")
    pairs = _pairs(len(tok))
    rows = answer_rows(pairs, tok.pad_token_id, torch.device("cpu"), False)
    with torch.no_grad():
        expected = answer_logprobs(base, rows).sum(-1)
    model, _ = _model(str(tiny_model_dir("llama")), lora=True)
    with as_reference(model):
        ref = answer_logprobs(model, rows).sum(-1)
    with torch.no_grad():
        policy = answer_logprobs(model, rows).sum(-1)
    torch.testing.assert_close(ref, expected, rtol=1e-6, atol=1e-6)
    assert (policy - expected).abs().max() > 1e-3  # the adapter does change the policy
    assert model.training  # as_reference restores the mode


@pytest.mark.parametrize("flat", [False, True], ids=["padded", "flat"])
def test_only_a_forward_with_gradients_runs_the_rounded_width(tiny_model_dir, flat: bool) -> None:
    """The rounded width keeps the policy's shapes few (CUDA graphs); a no-gradient pass (the
    reference) runs the real columns alone, with the same log-probs."""
    model, tok = _model(str(tiny_model_dir("llama")), lora=True)
    g = torch.Generator().manual_seed(5)
    pairs = [(torch.randint(4, len(tok), (p,), generator=g).tolist(), torch.randint(4, len(tok), (a,), generator=g).tolist())
             for p, a in [(10, 9), (7, 8)]]  # rows of 19 and 15 tokens: widths 20 (padded) and 36 (flat) rounded
    rows = answer_rows(pairs, tok.pad_token_id, torch.device("cpu"), flat)
    assert (rows.input_ids.shape[1], rows.used) == ((36, 34) if flat else (20, 19))
    widths, starts = [], []
    stack = model.get_base_model().model

    def seen(module: torch.nn.Module, args: tuple, kw: dict) -> None:
        widths.append(kw["input_ids"].shape[1])
        given = kw.get(STARTS_KWARG)  # flat rows hand the forward their host starts, cut to the call's columns
        starts.append(None if given is None else given.starts.shape[1])

    hook = stack.register_forward_pre_hook(seen, with_kwargs=True)
    with torch.no_grad():
        exact = answer_logprobs(model, rows)
    rounded = answer_logprobs(model, rows)
    hook.remove()
    assert widths == [rows.used, rows.input_ids.shape[1]]
    assert starts == (widths if flat else [None, None])
    torch.testing.assert_close(exact, rounded.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gemma4", "gemma3"])
def test_an_image_text_models_answers_take_its_language_models_logit_cap(kind: str, demo_tokenizer, tmp_path) -> None:
    """Gemma's final logit cap lives in an image-text checkpoint's text_config: the answers' log-probs cap their
    logits as the model's own head does (Gemma 4's image-text class and Kestrel's head both apply it)."""
    from kestrel.model.registry import logit_softcap
    from tests.support.tiny_image_text import tiny_image_text_model

    tiny_image_text_model(kind, len(demo_tokenizer), seed=1).save_pretrained(tmp_path)
    demo_tokenizer.save_pretrained(tmp_path)
    model, tok = _model(str(tmp_path), lora=True)
    assert logit_softcap(model.config) == 30.0 and getattr(model.config, "final_logit_softcapping", None) is None
    with torch.no_grad():  # logits of the cap's size, where it changes them (a tiny model's are below 1)
        model.get_output_embeddings().weight.mul_(60.0)
    pairs = _pairs(len(tok))
    rows = answer_rows(pairs, tok.pad_token_id, torch.device("cpu"), False)
    with torch.no_grad():
        seq = answer_logprobs(model, rows).sum(-1)
        expected = torch.stack([_full_sequence_logp(model, p, a) for p, a in pairs])
    torch.testing.assert_close(seq, expected, rtol=1e-5, atol=1e-5)


def test_the_logit_cap_is_read_where_each_config_holds_it() -> None:
    from kestrel.model.registry import logit_softcap

    assert logit_softcap({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}) == 30.0
    assert logit_softcap({"model_type": "gemma3", "vision_config": {},
                          "text_config": {"model_type": "gemma3_text", "final_logit_softcapping": 50.0}}) == 50.0
    assert logit_softcap({"model_type": "gemma3_text", "final_logit_softcapping": None}) is None
    assert logit_softcap({"model_type": "llama", "final_logit_softcapping": 30.0}) is None  # Llama has no cap
    assert logit_softcap({"model_type": "gemma2", "final_logit_softcapping": 30.0}) == 30.0  # HF's name, unknown family
