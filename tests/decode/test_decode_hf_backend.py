"""Families without Kestrel's decode forward (Qwen3.5's and Qwen3.5-MoE's linear attention,
Gemma 4's per-layer inputs) decode through Hugging Face's forward and cache, with the generator's own loop: greedy tokens equal HF's generate, left-padded batches equal rows one at a time, adapters by request."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kestrel.decode.adapters import AdapterError
from kestrel.decode.generate import Generator
from kestrel.decode.hf_backend import HFDecodeBackend
from kestrel.model.patching import patch_model
from kestrel.model.registry import DECODE_FAMILIES, SUPPORTED
from tests.support.tiny import tiny_model

VOCAB = 320
HF_DECODED = [f for f in SUPPORTED if f not in DECODE_FAMILIES]


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    model = tiny_model(family, VOCAB, seed=seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def test_the_families_without_kestrels_decode_forward_decode_through_hf() -> None:
    assert {"qwen3_5_text", "gemma4_text", "qwen3_5_moe_text"} <= set(HF_DECODED)
    assert not {"qwen3_moe", "gpt_oss"} & set(HF_DECODED)  # on Kestrel's decode forward (test_decode_moe.py)


@pytest.mark.parametrize("family", HF_DECODED)
def test_left_padded_rows_equal_rows_one_at_a_time(family: str) -> None:
    """Padding never reaches a row: masked in attention, zeroed before linear attention's state."""
    model = _model(family)
    patch_model(model)
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    assert isinstance(gen.backend, HFDecodeBackend) and not gen.cuda_graphs
    prompts = [_prompt(n, seed=n) for n in (5, 23, 11)]
    batched = gen.generate(prompts, max_new_tokens=12).tokens
    single = [gen.generate([p], max_new_tokens=12).tokens[0] for p in prompts]
    assert batched == single
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)[0, 5:].tolist()
    assert single[0] == ref


@pytest.mark.parametrize("family", HF_DECODED)
def test_adapters_by_request(family: str) -> None:
    targets = ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(_model(family), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    peft.eval()
    decoder = Generator(peft, max_seq_len=128, stop_ids=[])
    prompt = _prompt(9, seed=4)
    tuned = decoder.generate([prompt], max_new_tokens=10, adapter="default").tokens[0]
    base = decoder.generate([prompt], max_new_tokens=10).tokens[0]
    with torch.no_grad():
        ref_tuned = peft.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 9:].tolist()
        with peft.disable_adapter():
            ref_base = peft.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 9:].tolist()
    assert (tuned, base) == (ref_tuned, ref_base) and tuned != base
    with pytest.raises(AdapterError, match="one adapter per request"):
        decoder.generate([prompt, prompt], max_new_tokens=2, adapter=["default", None])


def test_a_model_in_training_mode_decodes_with_its_cache() -> None:
    """GRPO rolls out from a model in training mode: under gradient checkpointing HF would drop the
    cache there, so the backend runs the forward in eval mode and restores the mode after."""
    model = _model("qwen3_5_moe_text")
    model.gradient_checkpointing_enable()
    model.train()
    prompt = _prompt(9, seed=5)
    tokens = Generator(model, max_seq_len=64, stop_ids=[]).generate([prompt], max_new_tokens=8).tokens[0]
    assert model.training
    model.eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 9:].tolist()
    assert tokens == ref
