"""Fused q/k/v and gate/up products (weights re-pointed into one buffer) on every family (CPU, fp32).

The fused path must compute what the separate path computes, with and without adapters, and
leave the Hugging Face model exactly as it was for training and saving: same Parameter objects,
values and requires_grad, the same training loss and gradients, separate storage again after
`close()`, and adapter / full-model saving that works after decoding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from kestrel.decode.adapters import LoraCall
from kestrel.decode.generate import Generator
from kestrel.model.registry import DECODE_FAMILIES as SUPPORTED
from tests.decode.test_decode_hf import _hf_greedy, _model, _prompt, _with_adapters


def _logits(gen: Generator, ids: list[list[int]], lora: LoraCall | None, steps: int = 3) -> list[torch.Tensor]:
    """Prefill logits, then `steps` decode steps feeding the argmax: a list of (B, V)."""
    backend = gen.backend
    b, t = len(ids), len(ids[0])
    cache = backend.new_cache(b, t + steps + 1)
    pad = torch.zeros(b, dtype=torch.long)
    with torch.no_grad():
        out = [backend.prefill(torch.tensor(ids), pad, cache, lora)]
        for i in range(steps):
            tok = out[-1].argmax(-1)
            out.append(backend.step(tok, torch.tensor([t + i]), pad, cache, lora))
    return out


def _calls(gen: Generator, batch: int) -> list[tuple[str, LoraCall | None]]:
    calls: list[tuple[str, LoraCall | None]] = [("base", None)]
    calls += [(name, LoraCall(i)) for i, name in enumerate(gen.adapters)]
    if gen.adapters:
        rows = torch.zeros(batch, len(gen.adapters))
        rows[0, 0] = 1.0  # row 0 the first adapter, row 1 the last, row 2 (if any) the base
        rows[1, -1] = 1.0
        calls.append(("mixed", LoraCall(None, rows)))
    return calls


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor, bool]]:
    return {n: (id(p), p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}


def _owns_storage(p: torch.Tensor) -> bool:
    return p.untyped_storage().nbytes() == p.numel() * p.element_size()


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_fused_equals_separate_products(family: str, adapters: bool) -> None:
    model = _with_adapters(_model(family)) if adapters else _model(family)
    separate = Generator(model, max_seq_len=128, stop_ids=[], fuse=False)
    fused = Generator(model, max_seq_len=128, stop_ids=[])
    assert separate.backend.fused_groups == 0
    # q/k/v and gate/up always; o and down too with adapters (their shrink folds in); a sparse
    # MLP block (mixture of experts) has no gate/up or down group
    groups = [g for layer in fused.backend.layers for g in layer.groups]
    assert fused.backend.fused_groups == sum(len(g.projs) > 1 or adapters for g in groups)
    ids = [_prompt(13, seed=1), _prompt(13, seed=2), _prompt(13, seed=3)]
    for name, call in _calls(fused, len(ids)):
        for ours, ref in zip(_logits(fused, ids, call), _logits(separate, ids, call)):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    choice = ["qv", None, "default"] if adapters else None
    prompts = [_prompt(n, seed=n) for n in (6, 19, 11)]
    assert fused.generate(prompts, 40, adapter=choice).tokens == separate.generate(prompts, 40, adapter=choice).tokens


def test_fused_decoding_still_matches_hf_generate() -> None:
    peft = _with_adapters(_model("qwen2"))  # q/k/v biases: the fused bias buffer
    gen = Generator(peft, max_seq_len=256, stop_ids=[])
    assert gen.backend.layers[0].qkv.fused.bias is not None
    prompt = _prompt(17, seed=4)
    peft.set_adapter("default")
    assert gen.generate([prompt], 48, adapter="default").tokens[0] == _hf_greedy(peft, prompt, 48)


def test_model_is_unchanged_for_training_after_decoding_and_close() -> None:
    """Same Parameters, values, requires_grad; same loss and LoRA gradients; storage back on close()."""
    peft = get_peft_model(_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj",
                          "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], lora_dropout=0.0))
    peft.train()  # GRPO's state: train mode, frozen base
    reference = copy.deepcopy(peft)
    before = _snapshot(peft)
    gen = Generator(peft, max_seq_len=128, stop_ids=[])
    assert gen.backend.fused_groups == 4 * len(gen.backend.layers)
    tokens = gen.generate([_prompt(9, seed=5)], 16, adapter="default").tokens
    after = _snapshot(peft)
    assert after.keys() == before.keys()
    for name, (pid, value, grad) in before.items():
        assert after[name][0] == pid and after[name][2] == grad, name
        assert torch.equal(after[name][1], value), name
        assert peft.get_parameter(name).is_contiguous(), name
    ids = torch.tensor([_prompt(24, seed=6)])
    for m in (peft, reference):
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
    assert torch.equal(peft(ids, labels=ids).loss, reference(ids, labels=ids).loss)
    for (name, p), (_, q) in zip(peft.named_parameters(), reference.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    gen.close()
    assert gen.backend.fused_groups == 0
    for name, p in peft.named_parameters():
        assert _owns_storage(p), name
        assert torch.equal(p.detach(), before[name][1]), name
    assert gen.generate([_prompt(9, seed=5)], 16, adapter="default").tokens == tokens  # fuses again
    assert gen.backend.fused_groups > 0


def test_full_fine_tuning_keeps_separate_products() -> None:
    model = _model("llama").train()  # trainable base in train mode: full fine-tuning
    assert Generator(model, max_seq_len=64, stop_ids=[]).backend.fused_groups == 0
    assert all(_owns_storage(p) for p in model.parameters())
    model.eval()  # an inference-only load: trainable flags, but nothing trains
    assert Generator(model, max_seq_len=64, stop_ids=[]).backend.fused_groups > 0
    frozen = _model("llama").train().requires_grad_(False)
    assert Generator(frozen, max_seq_len=64, stop_ids=[]).backend.fused_groups > 0


def test_tied_projection_weights_are_not_fused() -> None:
    model = _model("llama")
    attn = model.model.layers[0].self_attn
    attn.v_proj.weight = attn.k_proj.weight  # one Parameter in two places
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    assert gen.backend.layers[0].qkv.fused is None and gen.backend.layers[1].qkv.fused is not None
    assert attn.v_proj.weight is attn.k_proj.weight
    prompt = _prompt(10, seed=7)
    assert gen.generate([prompt], 24).tokens[0] == _hf_greedy(model, prompt, 24)


def test_weight_updates_and_replacements_are_seen(tmp_path: Path) -> None:
    model = _model("mistral")
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    prompt = _prompt(12, seed=8)
    first = gen.generate([prompt], 24).tokens[0]
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[0].mlp
    with torch.no_grad():
        attn.k_proj.weight.mul_(3.0)  # in place: lands in the fused buffer
        mlp.up_proj.weight.data = mlp.up_proj.weight.data * -1.5  # new storage: re-bound
    second = gen.generate([prompt], 24).tokens[0]
    assert second == _hf_greedy(model, prompt, 24) and second != first
    state = {k: v * 0.5 if "q_proj" in k else v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new Parameter objects everywhere
    assert gen.generate([prompt], 24).tokens[0] == _hf_greedy(model, prompt, 24)
    assert gen.backend.fused_groups == 2 * len(gen.backend.layers)


def test_saving_after_decoding(tmp_path: Path) -> None:
    peft = _with_adapters(_model("qwen3"))
    gen = Generator(peft, max_seq_len=128, stop_ids=[])
    prompt = _prompt(11, seed=9)
    tokens = gen.generate([prompt], 24, adapter="default").tokens[0]
    peft.save_pretrained(tmp_path / "adapter")  # adapter tensors only
    reloaded = PeftModel.from_pretrained(_model("qwen3"), tmp_path / "adapter").eval()
    assert _hf_greedy(reloaded, prompt, 24) == tokens

    model = _model("qwen3")  # a chat load: the whole model, fused
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    tokens = gen.generate([prompt], 24).tokens[0]
    model.save_pretrained(tmp_path / "full")  # transformers clones the disjoint views
    loaded = type(model).from_pretrained(tmp_path / "full").eval()
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    assert _hf_greedy(loaded, prompt, 24) == tokens
    from safetensors.torch import save_model

    gen.close()  # separate storage again: safetensors' shared-tensor check passes on a raw save
    save_model(model, str(tmp_path / "raw.safetensors"))


def test_a_group_that_no_longer_fits_its_buffer_goes_back_to_separate_products() -> None:
    from kestrel.decode.projections import make_group

    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6, bias=False)
    group = make_group(a, b)
    assert group.fuse(torch.float32, set())
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        fused = group(x, None)
        torch.testing.assert_close(fused[0], a(x), rtol=0, atol=0)
        b.weight = torch.nn.Parameter(torch.randn(6, 8, dtype=torch.float64))  # the buffer is float32
        assert not group.repair() and group.fused is None
        assert _owns_storage(a.weight) and group.projs[1].weight is b.weight
        out = group.projs[1](x.double())
    torch.testing.assert_close(out, x.double() @ b.weight.T)
