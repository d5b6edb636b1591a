"""Training runs end to end on tiny models (CPU): loss curves, resume, adapters, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from kestrel.config import config_from_dict
from kestrel.errors import ModelLoadError
from kestrel.model.loader import load
from kestrel.training.metrics import Callback
from kestrel.model.registry import SUPPORTED
from kestrel.training.run import run
from tests.support.logs import Logs

ROOT = Path(__file__).resolve().parents[2]


def _cfg(model: str, out: Path, **kw) -> dict:
    base = dict(model=model, dataset="arithmetic_chat", output_dir=str(out), max_seq_length=64, batch_size=2,
                max_steps=30, learning_rate=1e-3, save_steps=0, seed=0, gradient_checkpointing="off")
    return {**base, **kw}


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", SUPPORTED)
def test_patched_and_unpatched_loss_curves_agree(family: str, tiny_model_dir, tmp_path: Path) -> None:
    model = str(tiny_model_dir(family))
    fast = run(config_from_dict(_cfg(model, tmp_path / "fast")))
    slow = run(config_from_dict(_cfg(model, tmp_path / "slow", fast_kernels=False)))
    assert fast.status == slow.status == "completed"
    a, b = _losses(tmp_path / "fast"), _losses(tmp_path / "slow")
    assert len(a) == len(b) == 30
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 0.01 * abs(y), f"step {step}: patched {x} vs unpatched {y}"
    assert a[-1] < a[0]


def test_checkpointing_modes_give_the_same_gradients(
    tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kestrel.recompute import checkpoint as checkpointing

    model = str(tiny_model_dir("llama"))
    taken: list[bool] = []  # offload: whether each recompute found its MLP's gate product kept
    real_take = checkpointing._KeptGate.take
    monkeypatch.setattr(checkpointing._KeptGate, "take", lambda self: taken.append(self.host is not None) or real_take(self))
    curves = {}
    for mode, gate in (("off", "1"), ("standard", "1"), ("offload", "1"), ("offload", "0")):
        monkeypatch.setenv("KESTREL_OFFLOAD_GATE", gate)
        run(config_from_dict(_cfg(model, tmp_path / f"{mode}{gate}", max_steps=5, gradient_checkpointing=mode,
                                  performance={"keep_attention": "off"})))  # counts the gate products' pages alone
        curves[mode, gate] = _losses(tmp_path / f"{mode}{gate}")
        if mode == "offload":  # every layer of every step, or none
            layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
            assert taken == ([True] * 5 * layers if gate == "1" else []), taken
            taken.clear()
    for key in (("standard", "1"), ("offload", "1"), ("offload", "0")):
        assert curves[key] == pytest.approx(curves["off", "1"], rel=1e-5), key


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step, self.seen = step, 0

    def on_step(self, metrics: dict) -> None:
        self.seen = int(metrics["step"])

    def should_stop(self):
        return "pause" if self.seen == self.step else None


def test_pause_then_resume_continues_without_duplicates(tiny_model_dir, tmp_path: Path) -> None:
    model = str(tiny_model_dir("qwen3"))
    straight = run(config_from_dict(_cfg(model, tmp_path / "straight", max_steps=12)))
    paused = run(config_from_dict(_cfg(model, tmp_path / "resumed", max_steps=12)), [StopAt(5)])
    assert (straight.status, paused.status, paused.step) == ("completed", "interrupted", 5)
    assert (tmp_path / "resumed" / "checkpoints" / "step-000005" / "state.json").is_file()
    resumed = run(config_from_dict(_cfg(model, tmp_path / "resumed", max_steps=12)))
    assert resumed.status == "completed"
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    assert _losses(tmp_path / "resumed") == pytest.approx(_losses(tmp_path / "straight"), rel=1e-4)


def test_saved_adapter_reloads_to_identical_logits(tiny_model_dir, tmp_path: Path) -> None:
    from peft import PeftModel

    model_dir = str(tiny_model_dir("llama"))
    result = run(config_from_dict(_cfg(model_dir, tmp_path / "run", max_steps=5, learning_rate=5e-3)))
    adapter = Path(result.output_dir) / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    base, tok = load(model_dir, 64, patch=False)
    ids = tok("What is 2 + 3?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, adapter).eval()
        logits_a = tuned(input_ids=ids).logits
        logits_b = PeftModel.from_pretrained(load(model_dir, 64, patch=False)[0], adapter).eval()(input_ids=ids).logits
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=0)
    assert not torch.allclose(logits_a, plain)  # the adapter learned something


def test_full_finetune_saves_a_model(tiny_model_dir, tmp_path: Path) -> None:
    result = run(config_from_dict(_cfg(str(tiny_model_dir("gemma3_text")), tmp_path / "full", method="full", max_steps=3)))
    assert result.status == "completed" and (tmp_path / "full" / "model" / "config.json").is_file()


def test_model_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load(str(tmp_path / "m"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(str(tmp_path / "missing"))


def test_hub_id_offline_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="could not find model 'nobody/no-such-model'.*Pick a local folder"):
        load("nobody/no-such-model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_4bit_without_cuda_says_train_in_16bit() -> None:
    with pytest.raises(ModelLoadError, match="needs an NVIDIA GPU.*method: lora"):
        load("demo", load_in_4bit=True)


def test_run_reports_dataset_errors_as_failed(tmp_path: Path) -> None:
    result = run(config_from_dict(_cfg("demo", tmp_path / "bad", dataset=str(tmp_path / "none.jsonl"))))
    assert result.status == "failed" and "does not exist" in result.error


def test_cli_trains_the_demo_model_and_loss_goes_down(tmp_path: Path) -> None:
    cfg = _cfg("demo", tmp_path / "cli", max_steps=20, batch_size=4, max_seq_length=96, learning_rate=3e-3, save_steps=10)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "kestrel", "train", str(path), "--lora.r", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "cli"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "vram_alloc_gib", "vram_reserved_gib", "vram_peak_gib"):
        assert key in rows[0]
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5])
    assert yaml.safe_load((out / "config.yaml").read_text())["lora"]["r"] == 8
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "checkpoints" / "step-000010").is_dir()


def test_cli_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: demo\nbatchsize: 2\n")
    proc = subprocess.run([sys.executable, "-m", "kestrel", "train", str(path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown config key batchsize" in proc.stderr


def test_lora_init_from_continues_a_trained_adapter(tiny_model_dir, tmp_path: Path) -> None:
    """A second run with lora.init_from starts from the first run's adapter (e.g. GRPO after a
    LoRA SFT): its first loss is the first run's last level, not the untrained model's."""
    model = str(tiny_model_dir("llama"))
    first = run(config_from_dict(_cfg(model, tmp_path / "a", max_steps=30, lora={"r": 8, "alpha": 16})))
    assert first.status == "completed"
    again = run(config_from_dict(_cfg(model, tmp_path / "b", max_steps=3, learning_rate=1e-9,
                                      lora={"init_from": str(tmp_path / "a")})))
    fresh = run(config_from_dict(_cfg(model, tmp_path / "c", max_steps=3, learning_rate=1e-9)))
    assert again.status == fresh.status == "completed"
    a, b, c = _losses(tmp_path / "a"), _losses(tmp_path / "b"), _losses(tmp_path / "c")
    # The loaded adapter already knows the data: the second run starts where the first ended
    # (measured: fresh 6.87, first run's end 6.2-6.3, continued 6.26).
    assert b[0] < c[0] - 0.3, (a[-1], b[0], c[0])
    assert abs(b[0] - a[-1]) < 0.15, (a[-1], b[0])
    saved = json.loads((tmp_path / "b" / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 8  # the loaded adapter's shape, not the default r=16


def test_lora_init_from_a_folder_without_adapter_is_a_clear_error(tiny_model_dir, tmp_path: Path) -> None:
    result = run(config_from_dict(_cfg(str(tiny_model_dir("llama")), tmp_path / "x", max_steps=1,
                                       lora={"init_from": str(tmp_path / "nowhere")})))
    assert result.status == "failed"
    assert "lora.init_from" in result.error and "adapter_config.json" in result.error


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_5_moe_text"])
def test_moe_run_reports_the_router_aux_loss(family: str, tiny_model_dir, tmp_path: Path) -> None:
    result = run(config_from_dict(_cfg(str(tiny_model_dir(family)), tmp_path / "moe", max_steps=3)))
    assert result.status == "completed"
    rows = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["aux_loss"] > 0 for row in rows)


def test_linear_attention_packs_on_kestrels_forward_and_says_why_not_without_it(tiny_model_dir, tmp_path: Path) -> None:
    """Qwen3.5's patched layers keep each packed sample's state and convolution to itself, so it
    packs like the attention-only families; with the fast kernels off, HF's layers would carry them
    from one sample into the next, so it trains one sample a row and the run's log says why."""
    from kestrel.data.collate import BatchPlan

    planned: list[bool] = []
    real_init = BatchPlan.__init__

    def spy(self, samples, batch_size, packing, *args, **kwargs):
        planned.append(packing)
        real_init(self, samples, batch_size, packing, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BatchPlan, "__init__", spy)
        for family, fast in (("qwen3_5_text", True), ("qwen3", True), ("qwen3_5_text", False)):
            logs = Logs()
            out = run(config_from_dict(_cfg(str(tiny_model_dir(family)), tmp_path / f"{family}-{fast}", max_steps=2,
                                            packing=True, fast_kernels=fast)), [logs])
            assert out.status == "completed"
            said = any(line.startswith("packing off: qwen3_5_text's linear-attention layers") for line in logs.lines)
            assert said == (not fast)
            assert "CUDA allocator: no CUDA device: nothing to set" in logs.lines  # `performance.cuda_allocator`
    assert planned == [True, True, False]
