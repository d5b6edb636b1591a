"""NF4 (QLoRA) bases in the decode path: each group's NF4 weights read by kernels/nf4_gemv.py at
2-16 rows, against the dequantized 16-bit model (every NF4 linear replaced by an nn.Linear holding
its dequantized weight). Greedy tokens must be identical, with and without LoRA adapters.

CPU: bitsandbytes quantizes on the CPU and the kernel runs through Triton's interpreter
(KESTREL_KERNELS=triton). GPU: the model loaded in 4 bits by transformers, steps compiled and
graph-captured.
"""

from __future__ import annotations

import copy
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from kestrel.decode.adapters import LoraCall, selection_rows
from kestrel.decode.generate import Generator
from kestrel.decode.projections import base_module
from tests.support.tiny import tiny_model
from kestrel.kernels import nf4
from kestrel.kernels.decode import nf4_gemv, nf4_tiles
from tests.decode.test_decode_hf import VOCAB, _prompt, _with_adapters

bnb = pytest.importorskip("bitsandbytes")


_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "base_layer"}


def _replace_linears(model: nn.Module, make) -> nn.Module:
    """Every projection's base (PEFT's base_layer under an adapter) replaced by make(base); lm_head
    and the adapters' own linears stay."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in _PROJECTIONS and not hasattr(child, "base_layer"):
                setattr(parent, name, make(child))
    return model


def _to_nf4(linear: nn.Linear) -> nn.Module:
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=linear.weight.dtype, compress_statistics=True, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4")
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    q.support_avx512bf16_for_cpu = False  # else its first CPU call repacks the weight for bitsandbytes' kernel
    return q.to(linear.weight.device)  # quantizes


def _to_dense(q: nn.Module) -> nn.Module:
    state = getattr(q.weight, "quant_state", None)
    if state is None:
        return q
    dense = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, device=q.weight.device,
                      dtype=state.dtype)
    with torch.no_grad():
        dense.weight.copy_(nf4.dequantize_reference(q.weight, state))
        if q.bias is not None:
            dense.bias.copy_(q.bias)
    return dense.requires_grad_(False)


def _pair(adapters: bool, device: str = "cpu"):
    """(NF4 model, its dequantized 16-bit twin), bf16, with the same adapters when asked."""
    model = tiny_model("llama", VOCAB, seed=0, dtype=torch.bfloat16).to(device)
    model.generation_config.eos_token_id = None
    if adapters:
        model = _with_adapters(model)
    quantized = _replace_linears(model, _to_nf4).eval()
    twin = _replace_linears(copy.deepcopy(quantized), _to_dense).eval()
    return quantized, twin


@pytest.mark.slow
def test_nf4_tokens_equal_dequantized_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    quantized, twin = _pair(adapters=False)
    gen = Generator(quantized, max_seq_len=128, stop_ids=[])
    assert gen.backend.compilable and all(g.nf4 is not None for g in gen.backend.groups if g.quantized)
    assert len(gen.backend.layers[0].qkv.nf4.sizes) == 3 and len(gen.backend.layers[0].gate_up.nf4.sizes) == 2
    prompts = [_prompt(n, seed=n) for n in (5, 19, 11)]
    for fuse in (False, None):  # the same step as NF4's; the fused 16-bit one
        dense = Generator(twin, max_seq_len=128, stop_ids=[], fuse=fuse)
        for rows in (prompts[:1], prompts):
            assert gen.generate(rows, 12).tokens == dense.generate(rows, 12).tokens, (fuse, len(rows))


@pytest.mark.parametrize("every_group", [True, False])
def test_measured_plans_decide_whether_one_row_takes_the_kernel(every_group: bool, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's table (here a temporary one for the CPU): when every group's plan measured the
    kernel faster at one row, a batch-1 step reads all of them through it (and its tiles), the
    compiled step's condition; when one shape's plan did not, batch-1 steps take the modules' path
    and only that shape's groups call their modules."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    monkeypatch.setattr(nf4_tiles, "TABLE", tmp_path / "tiles.json")
    quantized, twin = _pair(adapters=False)
    groups = [g for g in Generator(quantized, max_seq_len=64, stop_ids=[]).backend.groups if g.nf4 is not None]
    one_row = nf4_gemv.Tiles(1, 4, 64, 2)
    slower = (groups[0].nf4.n, groups[0].nf4.k)  # the shape whose plan keeps one row off (not every_group)
    for g in groups:
        plan = nf4_tiles.Plan(((1, one_row), (16, nf4_gemv.Tiles(16, 16, 64, 1))),
                              every_group or (g.nf4.n, g.nf4.k) != slower)
        nf4_tiles.store_plan("cpu", g.nf4.n, g.nf4.k, plan)
    gen = Generator(quantized, max_seq_len=64, stop_ids=[])
    assert gen.backend.nf4_min_rows == (1 if every_group else 2)
    launched, real = [], nf4_gemv.nf4_gemv

    def spy(x: torch.Tensor, w: nf4_gemv.NF4Weight, tiles: nf4_gemv.Tiles | None = None) -> torch.Tensor:
        if nf4_gemv.rows_of(x) == 1:  # not the prefill's 6 rows
            launched.append((w.n, w.k, w.tiles_for(1)))
        return real(x, w, tiles)

    monkeypatch.setattr(nf4_gemv, "nf4_gemv", spy)
    rows = [_prompt(6, seed=2)]
    tokens = gen.generate(rows, 3).tokens
    assert launched and all(t == one_row for _, _, t in launched)
    assert any((n, k) == slower for n, k, _ in launched) == every_group  # otherwise that group's modules ran
    assert tokens == Generator(twin, max_seq_len=64, stop_ids=[], fuse=False).generate(rows, 3).tokens


def _teacher_forced(backend, ids: torch.Tensor, lora: LoraCall | None, steps: int = 4) -> list[torch.Tensor]:
    """Logits (B, V) of prefill and of `steps` decode steps fed fixed tokens."""
    b, t = ids.shape
    pad = torch.zeros(b, dtype=torch.long)
    cache = backend.new_cache(b, t + steps + 1)
    with torch.no_grad():
        out = [backend.prefill(ids, pad, cache, lora)]
        for s in range(steps):
            out.append(backend.step(ids[:, s], torch.tensor([t + s]), pad, cache, lora))
    return out


def test_adapters_on_nf4_match_dequantized_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA on top of the NF4 groups (the separate path's expand): logits of a uniform and a
    per-row adapter choice equal the dequantized model's to bf16 rounding (the adapters here
    are large, so greedy near-ties between rounding orders are compared as logits)."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    quantized, twin = _pair(adapters=True)
    ours, dense = (Generator(m, max_seq_len=64, stop_ids=[], fuse=False).backend for m in (quantized, twin))
    assert all(g.nf4 is not None and g.lora is not None for g in ours.layers[0].__dict__.values()
               if hasattr(g, "nf4") and g.quantized)
    ids = torch.tensor([_prompt(9, seed=s) for s in range(3)])
    mixed = selection_rows(ours.adapters, ["qv", None, "default"]).to(torch.bfloat16)
    for lora, rows in ((LoraCall(ours.adapters.index("default")), ids[:1]), (LoraCall(None, mixed), ids)):
        for a, b in zip(_teacher_forced(ours, rows, lora), _teacher_forced(dense, rows, lora), strict=True):
            # 3% of the logits' range: the dense reference's bf16 CPU products round differently
            # between instruction sets (2.6% seen on an AVX2 machine); the adapters move it > 0.1
            scale = float(b.abs().max())
            torch.testing.assert_close(a, b, rtol=2e-2, atol=3e-2 * scale)
        base = _teacher_forced(dense, rows, None)[-1]
        assert (base - _teacher_forced(ours, rows, lora)[-1]).abs().max() > 0.1  # the adapters do change it


def test_more_rows_than_the_kernel_takes_call_the_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    quantized, twin = _pair(False)
    gen = Generator(quantized, max_seq_len=64, stop_ids=[])
    group = gen.backend.layers[0].qkv
    assert group.nf4 is not None
    x = torch.randn(17, 1, 128, dtype=torch.bfloat16)
    expected = [base_module(m)(x) for m in group.modules]
    assert all(torch.equal(a, b) for a, b in zip(group(x, None), expected))  # the modules, as before
    rows = [_prompt(7, seed=1)] * 17
    dense = Generator(twin, max_seq_len=64, stop_ids=[], fuse=False)
    assert gen.generate(rows, 4).tokens == dense.generate(rows, 4).tokens


def test_replaced_weight_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member whose Params4bit is replaced (a reload, PEFT's merge) is re-read before the next
    request, and the step changes with it."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    quantized, _ = _pair(False)
    gen = Generator(quantized, max_seq_len=64, stop_ids=[])
    prompt = [_prompt(9, seed=2)]
    before = gen.generate(prompt, 8).tokens
    layer = quantized.model.layers[0].mlp
    old = gen.backend.layers[0].gate_up.nf4
    fresh = _to_nf4(nn.Linear(128, 256, bias=False, dtype=torch.bfloat16))
    layer.gate_proj.weight = fresh.weight
    assert gen.backend.refresh()  # layout changed: graphs would be recaptured
    assert gen.backend.layers[0].gate_up.nf4 is not old
    assert gen.backend.layers[0].gate_up.nf4.packed[0].data_ptr() == fresh.weight.data_ptr()
    assert gen.generate(prompt, 8).tokens != before


def parting(reference: nn.Module, prompt: list[int], ours: list[int], theirs: list[int]
            ) -> tuple[int, torch.Tensor] | None:
    """Where two greedy paths part: (step, the prompt and the shared tokens before it as (1, T) ids
    on `reference`'s device), or None where they are equal (and of one length)."""
    diverged = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if diverged is None:
        assert len(ours) == len(theirs)
        return None
    return diverged, torch.tensor([prompt + theirs[:diverged]], device=next(reference.parameters()).device)


def _assert_same_until_near_tie(reference: nn.Module, prompt: list[int], ours: list[int], theirs: list[int],
                                rel_gap: float = 1e-2) -> None:
    """Greedy tokens equal, or equal up to a step where the reference's top two logits sit within
    `rel_gap` of each other (bf16 sums in another order may flip such a tie); past it the paths differ
    by design. Our token must be one of the reference's top two there."""
    parted = parting(reference, prompt, ours, theirs)
    if parted is None:
        return
    diverged, ids = parted
    with torch.no_grad():
        top = reference(ids).logits[0, -1].float().topk(2)
    gap = float((top.values[0] - top.values[1]) / top.values[0].abs())
    assert gap < rel_gap, f"tokens differ at step {diverged} where the reference has no near-tie (gap {gap:.2e})"
    assert ours[diverged] in top.indices.tolist()


@pytest.mark.gpu
def test_cuda_nf4_graphed_tokens_equal_dequantized(tmp_path: Path) -> None:
    """Compiled and graph-captured, against the dequantized model's same step (fuse=False: only
    the products differ): 8 rows, and one row with the kernel taking it too (MIN_ROWS = 1; by
    default one row calls bitsandbytes' GEMV, which multiplies in bf16)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.decode.test_decode_gpu import _assert_graphed

    tiny_model("llama", VOCAB, seed=0, dtype=torch.bfloat16).save_pretrained(tmp_path / "m")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    model.generation_config.eos_token_id = None
    twin = _replace_linears(copy.deepcopy(model), _to_dense)
    dense = Generator(twin, max_seq_len=256, stop_ids=[], fuse=False)
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 8, 12, 25, 4, 9)]
    gen = Generator(model, max_seq_len=256, stop_ids=[])
    assert gen.compile and all(g.nf4 is not None for g in gen.backend.groups if g.quantized)
    assert gen.generate(prompts, 48).tokens == dense.generate(prompts, 48).tokens
    _assert_graphed(gen)
    with mock.patch.object(nf4_gemv, "MIN_ROWS", 1):
        one = Generator(model, max_seq_len=256, stop_ids=[])
        ours, theirs = one.generate(prompts[1:2], 48).tokens[0], dense.generate(prompts[1:2], 48).tokens[0]
        _assert_same_until_near_tie(twin, prompts[1], ours, theirs)
    peft = _with_adapters(model)
    gen = Generator(peft, max_seq_len=256, stop_ids=[])
    dense = Generator(_replace_linears(copy.deepcopy(peft), _to_dense), max_seq_len=256, stop_ids=[], fuse=False)
    same = 0
    for adapter in (["default"] * 3, ["qv", None, "default"]):
        ours, theirs = gen.generate(prompts[:3], 32, adapter=adapter).tokens, dense.generate(
            prompts[:3], 32, adapter=adapter).tokens
        same += sum(a == b for a, b in zip(ours, theirs))
    _assert_graphed(gen)
    assert same >= 5  # large random adapters: a near-tie may flip a row (the CPU test compares logits)
