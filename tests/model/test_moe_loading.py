"""Loading mixture-of-experts checkpoints: gpt-oss's MXFP4 experts dequantized, its attention
in eager (HF has no SDPA path for attention sinks), patched and trainable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kestrel.errors import ModelLoadError
from kestrel.model.loader import load
from tests.support.mxfp4 import write_mxfp4_gpt_oss
from tests.support.tiny import tiny_model


def test_gpt_oss_mxfp4_checkpoint_loads_dequantized(tmp_path: Path, demo_tokenizer) -> None:
    source = tiny_model("gpt_oss", len(demo_tokenizer), seed=0)
    expected = write_mxfp4_gpt_oss(source, tmp_path)
    demo_tokenizer.save_pretrained(tmp_path)
    model, _ = load(str(tmp_path), 64, dtype="fp32", device="cpu")
    assert model.config._attn_implementation == "eager"
    assert model.kestrel_patch is not None
    params = dict(model.named_parameters())
    for name, value in expected.items():
        assert params[name].dtype == torch.float32
        torch.testing.assert_close(params[name], value, rtol=0, atol=0)  # MXFP4 values are exact in bf16 and fp32
    ids = torch.randint(0, len(demo_tokenizer), (1, 12))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert torch.isfinite(out.loss) and out.aux_loss is not None


def test_gpt_oss_mxfp4_refuses_4bit_loading(tmp_path: Path, demo_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mxfp4_gpt_oss(tiny_model("gpt_oss", len(demo_tokenizer)), tmp_path)
    demo_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="MXFP4"):
        load(str(tmp_path), 64, load_in_4bit=True, device="cuda")
