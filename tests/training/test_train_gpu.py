"""Training on CUDA: patched vs unpatched curves in bf16 on every family, and a real out-of-memory.

These need a GPU (`@pytest.mark.gpu`); the CPU suite covers the same math in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kestrel.config import config_from_dict
from kestrel.model.registry import FAMILIES, SUPPORTED
from tests.model.test_model_forward import PACKING_BLIND
from tests.support.tiny import tiny_model
from kestrel.training.run import run

pytestmark = pytest.mark.gpu


def _cfg(model: str, out: Path, **kw) -> dict:
    base = dict(model=model, dataset="arithmetic_chat", output_dir=str(out), max_seq_length=128, batch_size=4,
                max_steps=20, learning_rate=1e-3, save_steps=0, seed=0, gradient_checkpointing="standard",
                dtype="bf16")
    return {**base, **kw}


def _hf_trains(family: str) -> bool:
    """Whether unpatched Hugging Face can train `family` here: its linear-attention models (Qwen3.5) bind
    flash-linear-attention at import where it is installed, whose backward refuses Hopper under
    Triton below 3.7.1 (bench/RESULTS.md, session 18); Kestrel probes that and trains past it."""
    from kestrel.model import linear_attention

    if not family.startswith("qwen3_5"):
        return True
    ops = linear_attention._fla_ops()
    return ops is None or linear_attention.fla_backward_works(torch.device("cuda"), ops[0])


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_patched_bf16_curve_matches_unpatched_on_cuda(family: str, packing: bool, tiny_model_dir, tmp_path: Path) -> None:
    if packing and family in PACKING_BLIND:
        pytest.skip("HF's own forward lets packed samples see each other here; ours keeps them apart")
    if packing and FAMILIES[family].linear_attention_class:
        pytest.skip("unpatched, its linear attention would carry state across packed samples, so the reference run "
                    "trains unpacked, on other batches than the packed run's: no curve to compare. Packed rows are "
                    "checked sample by sample against HF in tests/model/test_linear_attention_packing.py (CPU, CUDA)")
    if not _hf_trains(family):
        pytest.skip("unpatched HF binds flash-linear-attention, whose backward refuses this GPU: no reference here")
    model = str(tiny_model_dir(family))
    fast = run(config_from_dict(_cfg(model, tmp_path / "fast", packing=packing)))
    slow = run(config_from_dict(_cfg(model, tmp_path / "slow", packing=packing, fast_kernels=False)))
    assert fast.status == slow.status == "completed", (fast.error, slow.error)
    a, b = _losses(tmp_path / "fast"), _losses(tmp_path / "slow")
    assert len(a) == len(b) == 20
    # bf16 rounding differs between fused and unfused paths; 3% per step over 20 steps, and the
    # curves must fall together.
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 0.03 * abs(y), f"step {step}: patched {x} vs unpatched {y}"
    assert a[-1] < a[0] and b[-1] < b[0]


def test_qlora_patched_curve_matches_unpatched_on_cuda(tiny_model_dir, tmp_path: Path) -> None:
    model = str(tiny_model_dir("llama"))
    fast = run(config_from_dict(_cfg(model, tmp_path / "fast", method="qlora")))
    slow = run(config_from_dict(_cfg(model, tmp_path / "slow", method="qlora", fast_kernels=False)))
    assert fast.status == slow.status == "completed", (fast.error, slow.error)
    for step, (x, y) in enumerate(zip(_losses(tmp_path / "fast"), _losses(tmp_path / "slow")), 1):
        assert abs(x - y) <= 0.03 * abs(y), f"step {step}: patched {x} vs unpatched {y}"


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
@pytest.mark.parametrize("graphs", ["0", "1"], ids=["eager", "graphed"])
def test_qlora_offload_pages_gate_products_out_and_keeps_the_curve(
    tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, graphs: str, family: str
) -> None:
    """Every layer of every step pages its gate product out and takes it back, eagerly or
    through its graphs' static buffers (for the batch shapes seen before), with the curve of
    standard checkpointing; Qwen3.5's too, after a linear-attention or a full-attention mixer."""
    from kestrel.recompute import checkpoint as checkpointing

    monkeypatch.setenv("KESTREL_CUDA_GRAPHS", graphs)
    model = str(tiny_model_dir(family))
    taken: list[bool] = []
    statics: list[bool] = []
    real_take, real_copy_out = checkpointing._KeptGate.take, checkpointing._KeptGate.copy_out
    monkeypatch.setattr(checkpointing._KeptGate, "take", lambda self: taken.append(self.host is not None) or real_take(self))
    monkeypatch.setattr(checkpointing._KeptGate, "copy_out",
                        lambda self: statics.append(self.static is not None) or real_copy_out(self))
    curves = {}
    for mode in ("standard", "offload"):  # the gate product's pages alone (kept attention: its own tests)
        result = run(config_from_dict(_cfg(model, tmp_path / mode, method="qlora", gradient_checkpointing=mode,
                                           performance={"keep_attention": "off"})))
        assert result.status == "completed", result.error
        curves[mode] = _losses(tmp_path / mode)
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    assert taken.count(True) == 20 * layers  # every layer of every step took its E back
    if graphs == "0":
        assert taken == [True] * 20 * layers and statics == []
    else:  # the steps whose shapes repeat ran graphed, through the static buffers
        assert statics and all(statics), statics
    assert curves["offload"] == pytest.approx(curves["standard"], rel=1e-5)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_gemma4_graphed_curve_matches_eager(tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            method: str) -> None:
    """Gemma 4's linked layers (per-layer inputs, shared K/V) replay as CUDA graphs in a run (the
    padded shapes that recur), every capture succeeds, and the curve is the eager run's."""
    from kestrel.recompute import layer_graphs

    model = str(tiny_model_dir("gemma4_text"))
    captures: list[tuple[bool, bool]] = []  # (linked, captured) per capture
    real_capture = layer_graphs.GraphedLayer._capture

    def spy(self, g, body):
        graph = real_capture(self, g, body)
        captures.append((self.links is not None, graph is not None))
        return graph

    monkeypatch.setattr(layer_graphs.GraphedLayer, "_capture", spy)
    curves = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("KESTREL_CUDA_GRAPHS", graphs)
        result = run(config_from_dict(_cfg(model, tmp_path / graphs, method=method)))
        assert result.status == "completed", result.error
        curves[graphs] = _losses(tmp_path / graphs)
        if graphs == "0":
            assert captures == []
    assert captures and all(linked and ok for linked, ok in captures), captures
    for step, (x, y) in enumerate(zip(curves["1"], curves["0"]), 1):
        assert abs(x - y) <= 1e-2 * abs(y), f"step {step}: graphed {x} vs eager {y}"


def test_real_out_of_memory_fails_with_advice_and_releases_the_gpu(demo_tokenizer, tmp_path: Path) -> None:
    """A genuine CUDA allocator OOM (memory capped for this process), not an injected one."""
    folder = tmp_path / "mid"
    # ~0.3 GB of bf16 weights: loads under the cap, but a batch of 64 x 1024 tokens without
    # checkpointing needs far more.
    tiny_model("llama", len(demo_tokenizer), hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4, head_dim=128).save_pretrained(folder)
    demo_tokenizer.save_pretrained(folder)
    rows = [{"text": " ".join(f"word{i % 97}" for i in range(2000))} for _ in range(128)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(3 * (1 << 30) / total)
    try:
        result = run(config_from_dict(_cfg(str(folder), tmp_path / "oom", dataset=str(data), max_seq_length=1024,
                                           batch_size=64, max_steps=2, gradient_checkpointing="off",
                                           train_on_responses_only=False)))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert result.status == "failed"
    assert "GPU out of memory" in result.error
    assert "batch_size (now 64)" in result.error and "max_seq_length (now 1024)" in result.error
    assert "offload" in result.error
    # The GPU is released: what the failed run allocated is gone, and training works again.
    assert torch.cuda.memory_allocated() - before < 64 * (1 << 20)
    ok = run(config_from_dict(_cfg(str(folder), tmp_path / "ok", dataset=str(data), max_seq_length=256,
                                   batch_size=2, max_steps=2, train_on_responses_only=False)))
    assert ok.status == "completed", ok.error
