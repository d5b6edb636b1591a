"""Every system of the benches trains the same adapters: the baselines get Kestrel's "every
linear" for the family (Qwen3.5's linear-attention projections too), and each record says which
modules carried adapters."""

from __future__ import annotations

import pytest
from peft import LoraConfig, get_peft_model

from bench.matrix import adapted
from bench.train import TARGETS, same_targets
from kestrel.config import LoraSettings
from kestrel.model.lora import attach_lora, every_linear
from tests.support.tiny import tiny_model

VOCAB = 64


@pytest.mark.parametrize(("family", "extra"), [("qwen3_5_text", ["in_proj_qkv", "in_proj_z", "out_proj"]),
                                               ("llama", [])])
def test_baselines_adapt_what_kestrel_adapts(family: str, extra: list[str]) -> None:
    base = tiny_model(family, VOCAB, seed=0)
    assert same_targets(base) == TARGETS + extra
    present = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
    hf = get_peft_model(base, LoraConfig(r=4, target_modules=[t for t in same_targets(base) if t in present]))
    ours = attach_lora(tiny_model(family, VOCAB, seed=0), LoraSettings(r=4, alpha=8, dropout=0.0, targets=list(TARGETS)))
    assert adapted(hf) == adapted(ours)
    assert set(extra) <= set(adapted(ours)["lora_targets"])


def test_a_narrower_list_is_left_as_given() -> None:
    """Only "every linear" widens: a user's own list of some linears is taken as it is."""
    model = tiny_model("qwen3_5_text", VOCAB, seed=0)
    assert every_linear(model, ["q_proj", "v_proj"]) == ["q_proj", "v_proj"]
    assert every_linear(model, TARGETS) == TARGETS + ["in_proj_qkv", "in_proj_z", "out_proj"]
