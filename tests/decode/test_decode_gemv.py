"""The one-row decode step on the Triton kernels, run through Triton's interpreter on the CPU
(KESTREL_KERNELS=triton), fp32: greedy tokens must be Hugging Face's. Llama-style families take
the five-launch layer (kestrel/decode/fast_layer.py: products with RoPE, cache writes, residual
adds, norms and SiLU * up in their epilogues, an adapter's shrink as partial sums of the launch
before; kernels/gemv_fused.py), with or without one adapter; QK-norm families take the general
step with its products on the matrix-vector kernel (kernels/gemv.py), with fused q/k/v +
gate/up, q/k/v biases, a tied lm_head and adapters whose A rows ride in the fused products.
Batches of several rows keep F.linear."""

from __future__ import annotations

import pytest

from kestrel.kernels.decode import gemv as gemv_module
from kestrel.decode import fast_layer
from kestrel.decode.generate import Generator
from tests.decode.test_decode_hf import _hf_greedy, _model, _one_thread, _prompt, _with_adapters  # noqa: F401


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """KESTREL_KERNELS=triton, and every kernel launch's weight shape recorded."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    calls: list[tuple[int, int]] = []
    launch = gemv_module.gemv

    def gemv(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return launch(x, weight, bias)

    monkeypatch.setattr(gemv_module, "gemv", gemv)
    return calls


@pytest.fixture
def fast_layers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every call of the five-launch layer, recorded."""
    calls: list[int] = []
    step = fast_layer.layer_step

    def layer_step(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(fast_layer, "layer_step", layer_step)
    return calls


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_one_row_fast_layers_match_hf(family: str, counted: list[tuple[int, int]], fast_layers: list[int]) -> None:
    model = _model(family)
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    assert gen.backend.fused_groups > 0
    prompt = _prompt(11, seed=4)
    assert gen.generate([prompt], max_new_tokens=12).tokens[0] == _hf_greedy(model, prompt, 12)
    # every decode step (the first token comes from prefill) runs every layer the fast way,
    # and its own lm_head product (with the final norm); prefill's lm_head takes `linear`
    assert len(fast_layers) == 11 * len(gen.backend.layers)
    assert len(counted) == 1


def test_qk_norm_family_products_on_gemv(counted: list[tuple[int, int]], fast_layers: list[int]) -> None:
    model = _model("qwen3")
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    prompt = _prompt(11, seed=4)
    assert gen.generate([prompt], max_new_tokens=12).tokens[0] == _hf_greedy(model, prompt, 12)
    assert not fast_layers
    per_step = 4 * len(gen.backend.layers) + 1  # q/k/v, o, gate/up, down per layer; lm_head
    assert len(counted) == 11 * per_step + 1


def test_one_row_adapters_match_cublas_path(counted: list[tuple[int, int]], fast_layers: list[int],
                                            monkeypatch) -> None:
    peft = _with_adapters(_model("qwen2"))
    gen = Generator(peft, max_seq_len=128, stop_ids=[])
    prompt = [_prompt(9, seed=6)]
    ours = {a: gen.generate(prompt, 8, adapter=a).tokens for a in ("default", "qv", None)}
    assert counted
    # base and both adapters (one adapter a call) run the fast layers; the shrinks on gemv
    assert len(fast_layers) == 3 * 7 * len(gen.backend.layers)
    monkeypatch.setenv("KESTREL_KERNELS", "torch")
    ref = Generator(peft, max_seq_len=128, stop_ids=[])
    for adapter, tokens in ours.items():
        assert tokens == ref.generate(prompt, 8, adapter=adapter).tokens, adapter


def test_batched_rows_keep_linear(counted: list[tuple[int, int]]) -> None:
    model = _model("llama")
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    prompts = [_prompt(7, seed=1), _prompt(10, seed=2)]
    out = gen.generate(prompts, max_new_tokens=6).tokens
    assert not counted
    assert out[1] == _hf_greedy(model, prompts[1], 6)
