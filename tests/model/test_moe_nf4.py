"""QLoRA on mixture-of-experts models: experts stored in NF4 (`kestrel.model.expert_quant`), on tiny
models loaded in 16/32-bit (HF's 4-bit loading needs CUDA; the expert step is the same after it)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kestrel.errors import ModelLoadError
from kestrel.kernels.moe import PackedExperts
from kestrel.model.expert_quant import packed_experts, quantize_experts
from kestrel.model.patching import patch_lora_layers, patch_model
from kestrel.model.registry import family_of
from tests.support.nf4_experts import assert_nf4_experts_hold
from tests.support.tiny import tiny_model

pytest.importorskip("bitsandbytes.functional")

VOCAB = 512
MOE = ("qwen3_moe", "gpt_oss", "qwen3_5_moe_text")
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _ids(seed: int, b: int = 2, t: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _expert_bytes(model: torch.nn.Module) -> int:
    """Bytes the experts' weights hold: packed NF4 where quantized, else the parameters' storage."""
    total = 0
    for module in model.modules():
        packed = packed_experts(module)
        for name in EXPERT_PARAMS:
            short = name.rsplit(".", 1)[-1]
            if short in packed:
                total += packed[short].nbytes + getattr(module, short).untyped_storage().nbytes()
            elif isinstance(getattr(module, short, None), torch.nn.Parameter):
                total += getattr(module, short).untyped_storage().nbytes()
    return total


def _nf4_model(family: str, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor], int]:
    """A patched tiny bf16 `family` model with NF4 experts, its experts' 16-bit weights by name, and
    their bytes before quantizing."""
    model = tiny_model(family, VOCAB, seed=seed, dtype=torch.bfloat16)
    patch_model(model)
    expected = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
    before = _expert_bytes(model)
    quantize_experts(model, family_of(family))
    return model, expected, before


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("family", MOE)
def test_nf4_experts_hold_their_rounded_weights_and_storage_a_quarter(family: str, seed: int) -> None:
    """Not the 16-bit model's logits (NF4's rounding times a tiny random model's gain, which moves
    with the seed: see tests/support/nf4_experts.py); the NF4 experts compute with their rounded weights."""
    model, expected, before = _nf4_model(family, seed)
    after = _expert_bytes(model)
    assert before > 0 and after < 0.27 * before  # bf16 -> 0.5 byte + absmax a parameter
    assert model.kestrel_expert_quant.nbytes <= after
    assert not any(p.requires_grad for n, p in model.named_parameters() if n in expected)
    assert_nf4_experts_hold(model, expected, _ids(seed))


def _read_gate_up_transposed(packed: dict[str, PackedExperts]) -> None:
    """Reads gate_up in the other orientation (square in the tiny models, so no shape error)."""
    packed["gate_up_proj"].transposed = not packed["gate_up_proj"].transposed


def _reorder_gate_up_columns(packed: dict[str, PackedExperts]) -> None:
    """Packs gate_up with its last dimension's even columns first, then the odd ones (for gpt-oss,
    whose gate and up columns interleave: [gate | up] halves)."""
    old = packed["gate_up_proj"]
    w = old.stored().clone()
    packed["gate_up_proj"] = PackedExperts(torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1), transposed=old.transposed)


def _pack_down_transposed(packed: dict[str, PackedExperts]) -> None:
    """Packs down_proj's (E, a, b) values in (E, b, a) order, under the (E, a, b) shape."""
    old = packed["down_proj"]
    w = old.stored().clone()
    packed["down_proj"] = PackedExperts(w.transpose(1, 2).contiguous().view(w.shape), transposed=old.transposed)


@pytest.mark.parametrize(("wrong", "caught_by"), [
    (_read_gate_up_transposed, "dequantized twin"), (_reorder_gate_up_columns, "gate_up_proj: a weight"),
    (_pack_down_transposed, "down_proj: a weight"),
], ids=["read-transposed", "gate-up-reordered", "down-packed-transposed"])
@pytest.mark.parametrize("family", MOE)
def test_nf4_expert_checks_fail_on_a_wrong_layout(family: str, wrong, caught_by: str) -> None:
    model, expected, _ = _nf4_model(family, seed=0)
    wrong(packed_experts(model.model.layers[1].mlp.experts))
    with pytest.raises(AssertionError, match=caught_by):
        assert_nf4_experts_hold(model, expected, _ids(0))


@pytest.mark.parametrize("family", MOE)
def test_qlora_on_nf4_experts_trains(family: str) -> None:
    model = tiny_model(family, VOCAB, seed=4)
    patch_model(model)
    quantize_experts(model, family_of(family))
    torch.manual_seed(5)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_parameters=EXPERT_PARAMS, target_modules=["q_proj"]))
    patch_lora_layers(model)
    model.train()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in trained)
    opt = torch.optim.AdamW(list(trained.values()), lr=1e-2)
    ids = _ids(2)
    before = {n: p.detach().clone() for n, p in trained.items() if "experts" in n}
    losses = []
    for _ in range(20):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


def _nf4_twins(seed: int) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """A patched tiny Qwen3-MoE with NF4 experts, its twin whose 16-bit experts hold the
    dequantized values, and the quantization handle."""
    quant = tiny_model("qwen3_moe", VOCAB, seed=seed)
    patch_model(quant)
    handle = quantize_experts(quant, family_of("qwen3_moe"))
    dense = copy.deepcopy(quant)
    dense.kestrel_expert_quant.undo()  # 16-bit parameters holding the dequantized values
    return quant, dense, handle


def _expert_lora(model: torch.nn.Module, seed: int, b_std: float) -> torch.nn.Module:
    """LoRA r=4 on every expert projection (seeded), B drawn from N(0, b_std) so it acts."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_parameters=EXPERT_PARAMS, target_modules=[]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, b_std)
    return peft_model


def test_nf4_experts_gradients_equal_16_bit_experts_holding_the_dequantized_values() -> None:
    """LoRA gradients through the NF4 product equal those through 16-bit experts set to the NF4 values."""
    quant, dense, handle = _nf4_twins(seed=6)
    assert handle.modules and not packed_experts(dense.model.layers[0].mlp.experts)
    grads = []
    for model in (quant, dense):
        peft_model = _expert_lora(model, seed=7, b_std=0.05)
        ids = _ids(3)
        peft_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7)


def test_nf4_experts_refuse_hf_own_forward_and_undo_restores_it() -> None:
    model = tiny_model("qwen3_moe", VOCAB, seed=8)  # not patched: HF's experts forward would run
    handle = quantize_experts(model, family_of("qwen3_moe"))
    with pytest.raises(ModelLoadError, match="NF4"):
        model(input_ids=_ids(4), use_cache=False)
    handle.undo()
    assert getattr(model, "kestrel_expert_quant", None) is None
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
               for n, p in model.named_parameters() if "experts" in n)
    assert torch.isfinite(model(input_ids=_ids(4), use_cache=False).logits).all()


def test_quantize_experts_refuses_after_lora() -> None:
    model = get_peft_model(tiny_model("qwen3_moe", VOCAB), LoraConfig(r=4, target_parameters=EXPERT_PARAMS, target_modules=[]))
    with pytest.raises(ValueError, match="before attaching LoRA"):
        quantize_experts(model, family_of("qwen3_moe"))


def test_loader_quantizes_the_experts_of_a_patched_model_only(caplog: pytest.LogCaptureFixture) -> None:
    """The loader's 4-bit step (after bitsandbytes' linears): NF4 experts when the MoE block is
    patched; an unpatched model keeps them 16-bit and the log says why."""
    from kestrel.model.loader import _quantize_experts

    patched, plain = tiny_model("qwen3_moe", VOCAB), tiny_model("qwen3_moe", VOCAB)
    with caplog.at_level("INFO", logger="kestrel"):
        _quantize_experts(patched, "tiny", patch_model(patched))
        _quantize_experts(plain, "tiny", None)
    assert packed_experts(patched.model.layers[0].mlp.experts)
    assert not packed_experts(plain.model.layers[0].mlp.experts)
    assert "attention and the experts to NF4" in caplog.text and "the experts stay torch.float32" in caplog.text


@pytest.mark.gpu
def test_4bit_loading_stores_moe_experts_in_nf4_and_trains(tiny_model_dir) -> None:
    from kestrel.model.loader import load

    model, _ = load(str(tiny_model_dir("qwen3_moe")), 64, load_in_4bit=True)
    experts = model.model.layers[0].mlp.experts
    assert set(packed_experts(experts)) == {"gate_up_proj", "down_proj"}
    assert experts.gate_up_proj.untyped_storage().nbytes() <= 2  # the placeholder's one element
    model = get_peft_model(model, LoraConfig(r=4, target_parameters=EXPERT_PARAMS, target_modules=["q_proj"]))
    ids = torch.randint(0, 100, (2, 16), device="cuda")
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "experts" in n and "lora_B" in n]  # B starts at 0: A's grad is 0
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("transposed", [False, True])
def test_selected_nf4_experts_equal_the_whole_dequantization(transposed: bool) -> None:
    """A decode step dequantizes only its top-k experts (`PackedExperts.select`): bit for bit the
    whole tensor's dequantization at those experts, repeats and any order included."""
    packed = PackedExperts(torch.randn(6, 64, 48, generator=torch.Generator().manual_seed(3)), transposed=transposed)
    index = torch.tensor([3, 0, 3, 5])
    assert packed.selectable and packed.state.nested
    assert torch.equal(packed.select(index), packed.stored().clone()[index])


@pytest.mark.parametrize("in_place", [False, True], ids=["gathered", "expert_gemv"])
def test_nf4_experts_decode_with_an_adapter_as_16_bit_experts_holding_their_values(
        in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPO rollouts and chat on a QLoRA MoE: Kestrel's decode forward (each step reading only the
    chosen experts, prefill the grouped product) gives the greedy tokens of 16-bit experts set to the
    NF4 values, adapter on and off. The NF4 model's steps gather the chosen experts (PyTorch) or read
    them in place (the Triton kernel `kestrel.kernels.decode.expert_gemv`, interpreted on a CPU; the
    rest of the step stays PyTorch); the 16-bit twin's always gather."""
    from kestrel.decode.generate import Generator
    from kestrel.decode.model import DecodeModel
    from kestrel.kernels.decode import expert_gemv

    launches: list[bool] = []
    kernel = expert_gemv.expert_gemv
    monkeypatch.setattr(expert_gemv, "expert_gemv", lambda x, ids, w: launches.append(w.nf4) or kernel(x, ids, w))
    quant, dense, _ = _nf4_twins(seed=9)
    ids = _ids(5, b=3, t=9)
    prompts = [ids[0].tolist(), ids[1, 4:].tolist(), ids[2, 2:].tolist()]  # a left-padded batch
    tokens = []
    for model in (quant, dense):
        model.generation_config.eos_token_id = None
        peft_model = _expert_lora(model, seed=10, b_std=0.5)
        peft_model.eval()
        gen = Generator(peft_model, max_seq_len=64, stop_ids=[])
        assert isinstance(gen.backend, DecodeModel)
        assert all((b.gate_up.packed is not None) == (model is quant) for b in gen.backend.moe_blocks)
        with monkeypatch.context() as patch:
            if in_place and model is quant:
                patch.setattr(expert_gemv, "applies", lambda x, w: not w.reason)
            tokens.append([gen.generate(prompts, max_new_tokens=8, adapter=a).tokens for a in ("default", None)])
    assert tokens[0] == tokens[1] and tokens[0][0] != tokens[0][1]
    assert launches == ([True] * len(launches) if in_place else []) and (launches or not in_place)
