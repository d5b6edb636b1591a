"""Offloaded checkpointing that keeps each layer's attention output (`keep_attention`): the recompute
runs no attention forward, and training is unchanged."""

from __future__ import annotations

import pytest
import torch

from kestrel.model import kept_attention as kept_module
from kestrel.model.registry import SUPPORTED
from kestrel.recompute.host_tensors import KeptAttentionOutput, OffloadState


def _train(folder, keep: bool, monkeypatch: pytest.MonkeyPatch, family_rows: int = 40, steps: int = 3,
           projection: bool = False, qkv: bool = False):
    """Losses over `steps` steps, the first step's adapter gradients, and how often each attention kernel
    ran (and, as "known" and "known_qkv", how often a recompute took the output projection's kept output, and
    Q, K and V, instead of their products)."""
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    monkeypatch.delenv("KESTREL_KEEP_ATTENTION", raising=False)
    monkeypatch.delenv("KESTREL_KEEP_PROJECTION", raising=False)
    monkeypatch.delenv("KESTREL_KEEP_QKV", raising=False)
    calls = {"forward": 0, "backward": 0, "known": 0, "known_qkv": 0}
    from kestrel.kernels import lora_linear_known as real_known, lora_projections_known as real_known_qkv

    def known(*a):
        calls["known"] += 1
        return real_known(*a)

    def known_qkv(*a):
        calls["known_qkv"] += 1
        return real_known_qkv(*a)

    monkeypatch.setattr(kept_module, "lora_linear_known", known)
    monkeypatch.setattr(kept_module, "lora_projections_known", known_qkv)

    def forward(*a):
        calls["forward"] += 1
        return kept_module.reference_forward(*a)

    def backward(*a):
        calls["backward"] += 1
        return kept_module.reference_backward(*a)

    monkeypatch.setattr(kept_module, "REFERENCE_CAUSAL", kept_module.CausalKernels(forward, backward))
    torch.manual_seed(0)
    model, _ = load(str(folder), 64, dtype="fp32", device="cpu")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    set_gradient_checkpointing(model, "offload", "off", keep_attention="on" if keep else "off",
                               keep_projection="on" if projection else "off", keep_qkv="on" if qkv else "off")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(5, 200, (2, family_rows), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads = grads or [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, calls


# How many of each tiny model's 2 layers run plain causal attention with no mask (keeping applies to those
# alone: windowed, masked, sink and varlen attention always recompute, and a linear-attention layer has none).
# Gemma 3's two tiny layers are both windowed; Gemma 4's full-attention layers get a mask from HF; gpt-oss has
# sinks; Qwen3.5's are one linear-attention layer and one full-attention layer that HF gives no mask.
PLAIN_LAYERS = {"llama": 2, "mistral": 2, "qwen2": 2, "qwen3": 2, "qwen3_moe": 2, "qwen3_5_text": 1,
                "qwen3_5_moe_text": 1}


@pytest.mark.parametrize(("projection", "qkv"), [(False, False), (True, False), (True, True), (False, True)],
                         ids=["attention", "attention-and-projection", "all", "attention-and-qkv"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_kept_attention_trains_as_recomputed_attention(family: str, projection: bool, qkv: bool, tiny_model_dir,
                                                       monkeypatch) -> None:
    folder = tiny_model_dir(family)
    base, base_grads, base_calls = _train(folder, False, monkeypatch)
    kept, kept_grads, calls = _train(folder, True, monkeypatch, projection=projection, qkv=qkv)
    assert base_calls == {"forward": 0, "backward": 0, "known": 0, "known_qkv": 0}  # off: SDPA in both passes
    steps = 3 * PLAIN_LAYERS.get(family, 0)  # 3 steps x the layers that keep
    # On: one forward a layer a step (the first pass), none in the recompute; one backward a layer a step;
    # with the projection (Q, K and V) kept, each recompute takes its output instead of forming it.
    assert calls == {"forward": steps, "backward": steps, "known": steps if projection else 0,
                     "known_qkv": steps if qkv else 0}, calls
    for a, b in zip(kept, base):
        assert abs(a - b) <= 1e-5 * abs(b)
    for a, b in zip(kept_grads, base_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_store_that_kept_nothing_means_attention_is_recomputed() -> None:
    store = KeptAttentionOutput(OffloadState())
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    assert store.take() is None
    with torch.no_grad():
        out = kept_module.stored_causal_attention(q, k, v, 0.5, store, hidden=4)
    got = store.take()
    assert got is not None and torch.equal(got[0], out)
    assert kept_module.stored_causal_attention(q.requires_grad_(True), k, v, 0.5, store, hidden=4) is None  # taken


def test_auto_keeps_rows_at_least_as_long_as_the_hidden_size() -> None:
    # S FLOPs of attention forward per byte of output against H per byte of the gate product E.
    assert kept_module.worth_keeping(4096, 4096) and kept_module.worth_keeping(8192, 2560)
    assert not kept_module.worth_keeping(2048, 4096)
    short, long_ = KeptAttentionOutput(OffloadState(), only_long=True), KeptAttentionOutput(OffloadState(), only_long=True)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    with torch.no_grad():
        assert kept_module.stored_causal_attention(q, k, v, 0.5, short, hidden=8) is None  # 6 rows < 8
        assert kept_module.stored_causal_attention(q, k, v, 0.5, long_, hidden=6) is not None
    assert short.take() is None and long_.take() is not None


@pytest.mark.gpu
@pytest.mark.parametrize(("qlora", "graphs", "projection", "qkv"), [
    (False, False, "off", "off"), (True, False, "off", "off"), (True, True, "off", "off"), (True, False, "on", "off"),
    (True, True, "on", "off"), (True, False, "on", "on"), (True, True, "on", "on"), (False, True, "off", "on"),
], ids=["lora", "qlora", "qlora-graphed", "qlora-projection", "qlora-graphed-projection", "qlora-all",
        "qlora-graphed-all", "lora-graphed-qkv"])
def test_kept_attention_trains_as_recomputed_attention_on_cuda(tiny_model_dir, monkeypatch, qlora: bool,
                                                               graphs: bool, projection: str, qkv: str) -> None:
    # bf16 on CUDA through cuDNN's kernels; graphed, the output and lse live in static buffers between the passes.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.recompute.test_layer_graphs import _train as train_cuda

    folder = tiny_model_dir("llama")
    base, base_w, base_stats = train_cuda(folder, graphs, monkeypatch, qlora=qlora, mode="offload")
    calls = {"forward": 0, "backward": 0}
    real = kept_module.CUDNN_CAUSAL

    def counted(name: str):
        def run(*a):
            calls[name] += 1
            return getattr(real, name)(*a)
        return run

    monkeypatch.setattr(kept_module, "CUDNN_CAUSAL", kept_module.CausalKernels(counted("forward"), counted("backward")))
    relaid, in_layout = [], kept_module._in_layout

    def counted_layout(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
        out = in_layout(t, strides)
        relaid.extend([tuple(t.shape)] if out is not t else [])
        return out

    # O and dO come back in the layout cuDNN's forward gave O (the host copy, the copy back and a graphed
    # layer's static buffer keep it): the backward lays neither out again (a copy of each, every layer)
    monkeypatch.setattr(kept_module, "_in_layout", counted_layout)
    kept, kept_w, stats = train_cuda(folder, graphs, monkeypatch, qlora=qlora, mode="offload", keep_attention="on",
                                     keep_projection=projection, keep_qkv=qkv)
    layers, steps = 2, 4  # the tiny llama's, `train_cuda`'s
    if not graphs:  # replays call no Python: counted only eagerly
        assert calls == {"forward": layers * steps, "backward": layers * steps}, calls
    else:
        assert calls["forward"] > 0, calls
    assert relaid == [], f"O or dO laid out again in the backward: {relaid}"
    if graphs:
        assert base_stats["kept"] == 0 and stats["kept"] == 2 and stats["eager_backwards"] == 0, stats
        assert stats["forward"] == stats["backward"] == 2 and stats["failed"] == 0, stats
    for step, (a, b) in enumerate(zip(kept, base)):
        assert abs(a - b) <= 1e-2 * abs(b), f"loss {step}: kept {a} vs recomputed {b}"
    for a, b in zip(kept_w, base_w):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=1e-3)
