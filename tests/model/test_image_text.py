"""Image-text checkpoints (Gemma 3 4B+, Mistral 3, Qwen3.5, Qwen3.5-MoE, Gemma 4 shapes) fine-tuned on text:
they load whole, train only their language model (the vision tower frozen and unchanged), patch
their language model's modules, and chat with HF's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kestrel.config import LoraSettings
from kestrel.decode.generate import Generator
from kestrel.model.loader import load
from kestrel.model.lora import attach_lora
from kestrel.model.multimodal import in_language_model, language_stack
from kestrel.model.registry import family_of
from tests.support.tiny_image_text import IMAGE_TEXT, tiny_image_text_model


@pytest.fixture(scope="module")
def image_text_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer):
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            tiny_image_text_model(kind, len(demo_tokenizer), seed=1).save_pretrained(folder)
            demo_tokenizer.save_pretrained(folder)
            made[kind] = folder
        return made[kind]

    return make


def _text_batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 14), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_text_training_changes_only_the_language_model(kind: str, image_text_dir) -> None:
    model, tokenizer = load(str(image_text_dir(kind)), 64, device="cpu")
    assert model.kestrel_patch.count > 0  # the language model's modules are on the fast path
    stack, _ = language_stack(model)
    vision = {n: p.detach().clone() for n, p in model.named_parameters() if not in_language_model(n, stack)}
    assert vision and not any(p.requires_grad for n, p in model.named_parameters() if n in vision)
    peft = attach_lora(model, LoraSettings(r=4, alpha=8))
    adapted = [n for n, _ in peft.named_modules() if n.endswith(".lora_A")]
    assert adapted and all(f"{stack}." in n for n in adapted)  # no vision projection has an adapter
    lora = {n: p.detach().clone() for n, p in peft.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    peft.train()
    for _ in range(2):
        peft(**_text_batch(len(tokenizer)), use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    params = dict(peft.base_model.model.named_parameters())
    for name, before in vision.items():
        assert params[name].grad is None and torch.equal(params[name], before), name
    assert all(not torch.equal(p, lora[n]) for n, p in peft.named_parameters() if n in lora and "lora_B" in n)


@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_full_fine_tuning_keeps_the_vision_tower_frozen(kind: str, image_text_dir, tmp_path: Path) -> None:
    from kestrel.config import config_from_dict
    from kestrel.training.recipe import prepare_model

    config = config_from_dict(dict(model=str(image_text_dir(kind)), dataset="arithmetic_chat", method="full",
                                   output_dir=str(tmp_path), gradient_checkpointing="off"))
    model, _ = load(config.model, 64, device="cpu")
    model, _ = prepare_model(config, model, tmp_path, _Quiet())
    stack, _ = language_stack(model)
    for name, param in model.named_parameters():
        assert param.requires_grad == in_language_model(name, stack), name


class _Quiet:
    def on_log(self, message: str) -> None:
        pass


@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_chat_gives_hf_greedy_tokens(kind: str, image_text_dir) -> None:
    model, _ = load(str(image_text_dir(kind)), 64, device="cpu")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(3, 200, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = Generator(model, max_seq_len=64, stop_ids=[]).generate([prompt], max_new_tokens=12).tokens[0]
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 11:].tolist()
    assert ours == ref


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5", "qwen3_5_moe"])
def test_a_training_run_on_an_image_text_folder(kind: str, image_text_dir, tmp_path: Path) -> None:
    """The product's run: recomputed layers start at the language model's first decoder layer (the
    vision encoder's come first in module order), the adapter saved covers the language model only."""
    import json

    from kestrel.config import config_from_dict
    from kestrel.recompute import checkpoint as checkpointing
    from kestrel.training.run import run

    firsts: list[str] = []
    real = checkpointing._first_decoder_layer

    def spy(model: torch.nn.Module, layers: list[torch.nn.Module]) -> torch.nn.Module | None:
        first = real(model, layers)
        firsts.append(type(first).__name__)
        return first

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpointing, "_first_decoder_layer", spy)
        result = run(config_from_dict(dict(
            model=str(image_text_dir(kind)), dataset="arithmetic_chat", output_dir=str(tmp_path), max_seq_length=64,
            batch_size=2, max_steps=3, learning_rate=1e-3, save_steps=0, seed=0, gradient_checkpointing="standard")))
    assert result.status == "completed", result
    assert firsts and all(name.endswith("DecoderLayer") for name in firsts), firsts
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert all("language_model" in name for name in adapter["target_modules"])
    experts = family_of(IMAGE_TEXT[kind][0]).moe is not None  # LoRA on the experts: PEFT's parameter targets
    assert bool(adapter.get("target_parameters")) == experts, adapter.get("target_parameters")


@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_the_image_text_forward_takes_a_batchs_host_starts(kind: str, image_text_dir) -> None:
    """Training hands a flat batch's sample starts to the forward (`attn.STARTS_KWARG`): the image-text class's
    own forward passes the keyword down to its language model (or its HF stack drops it), and the loss is the one
    without it."""
    from kestrel.model import attention as attn

    model, tokenizer = load(str(image_text_dir(kind)), 64, device="cpu")
    ids = torch.randint(0, len(tokenizer), (1, 14), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(9), torch.arange(5)])[None]  # two samples in one row
    batch = {"input_ids": ids, "position_ids": positions, "labels": ids}
    starts = {attn.STARTS_KWARG: attn.host_starts(None, positions, 1)}
    with torch.no_grad():
        plain, given = (model(**batch, use_cache=False, **extra).loss for extra in ({}, starts))
    torch.testing.assert_close(given, plain, rtol=0, atol=0)
