"""The decode path against Hugging Face on tiny models of every family (CPU, fp32).

Greedy tokens must be identical to `model.generate(do_sample=False)` for 64 tokens, with and
without LoRA adapters (random non-zero B), switching base/adapters on one loaded model, rows of
different lengths batched, and prefill logits must match HF's to fp32 precision.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kestrel.decode.generate import Generator
from kestrel.decode.sampling import SamplingParams
from kestrel.model.registry import DECODE_FAMILIES, SUPPORTED
from tests.support.tiny import tiny_model

VOCAB = 320
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls on a shared 2-core machine: OpenMP hand-offs cost more than the math.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(family: str, seed: int = 0):
    model = tiny_model(family, VOCAB, seed=seed)
    model.generation_config.eos_token_id = None  # run the full budget on both sides
    model.generation_config.pad_token_id = 0
    return model


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(model, prompt: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


def _with_adapters(model, target_parameters: list[str] | None = None):
    """Two adapters of different ranks and targets ("default" on every linear and on the 3-D
    `target_parameters`, "qv" on q/v only), B random so each really changes the output."""
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEARS,
                                            target_parameters=target_parameters, lora_dropout=0.0))
    peft.add_adapter("qv", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return peft.eval()


@pytest.mark.parametrize("family", SUPPORTED)
def test_greedy_matches_hf_generate(family: str) -> None:
    model = _model(family)
    gen = Generator(model, max_seq_len=256, stop_ids=[])
    prompt = _prompt(21, seed=1)  # 21 + 64 > Gemma's 16-token sliding window
    out = gen.generate([prompt], max_new_tokens=64)
    assert out.tokens[0] == _hf_greedy(model, prompt, 64)
    assert out.finish_reasons == ["length"]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("family", DECODE_FAMILIES)
def test_prefill_logits_match_hf(family: str, kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill's last logits and the cache it writes; with KESTREL_KERNELS=triton its norms and
    RoPE run as the Triton kernels (interpreted here), as on CUDA. Two left-padded rows."""
    monkeypatch.setenv("KESTREL_KERNELS", kernels)
    model = _model(family)
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    ids = torch.tensor([_prompt(19, seed=2), [0] * 4 + _prompt(15, seed=3)])
    cache = gen.backend.new_cache(2, 64)
    with torch.no_grad():
        ours = gen.backend.prefill(ids, torch.tensor([0, 4]), cache, None)
        ref = torch.cat([model(ids[:1]).logits[:, -1], model(ids[1:, 4:]).logits[:, -1]]).float()
        monkeypatch.setenv("KESTREL_KERNELS", "torch")
        plain = gen.backend.new_cache(2, 64)
        gen.backend.prefill(ids, torch.tensor([0, 4]), plain, None)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.buffer[..., :19, :], plain.buffer[..., :19, :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_batched_rows_of_different_lengths_equal_one_at_a_time(family: str) -> None:
    gen = Generator(_model(family), max_seq_len=256, stop_ids=[])
    prompts = [_prompt(n, seed=n) for n in (5, 30, 17)]
    batched = gen.generate(prompts, max_new_tokens=24).tokens
    single = [gen.generate([p], max_new_tokens=24).tokens[0] for p in prompts]
    assert batched == single


def test_repetition_penalty_greedy_matches_hf() -> None:
    model = _model("qwen2")
    gen = Generator(model, max_seq_len=256, stop_ids=[])
    prompt = _prompt(12, seed=3)
    out = gen.generate([prompt], 48, sampling=SamplingParams(repetition_penalty=1.5))
    assert out.tokens[0] == _hf_greedy(model, prompt, 48, repetition_penalty=1.5)


def test_seeded_sampling_batched_equals_one_at_a_time_and_repeats() -> None:
    gen = Generator(_model("llama"), max_seq_len=256, stop_ids=[])
    prompts = [_prompt(n, seed=n) for n in (7, 13)]
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1, seed=11),
        SamplingParams(temperature=1.3, seed=12),
    ]
    batched = gen.generate(prompts, 32, sampling=params).tokens
    single = [gen.generate([p], 32, sampling=[s]).tokens[0] for p, s in zip(prompts, params)]
    assert batched == single
    assert gen.generate(prompts, 32, sampling=params).tokens == batched
    other = [SamplingParams(temperature=0.9, seed=99), params[1]]
    assert gen.generate(prompts, 32, sampling=other).tokens[0] != batched[0]


def test_stop_token_ends_the_row_and_is_kept() -> None:
    model = _model("mistral")
    prompt = _prompt(9, seed=4)
    ref = _hf_greedy(model, prompt, 40)
    stop = ref[10]
    first = ref.index(stop)
    out = Generator(model, max_seq_len=128, stop_ids=[stop]).generate([prompt], 40)
    assert out.tokens[0] == ref[: first + 1]
    assert out.finish_reasons == ["stop"]


@pytest.mark.parametrize("family", DECODE_FAMILIES)
def test_unmerged_adapters_match_peft_and_switch_per_request(family: str) -> None:
    peft = _with_adapters(_model(family))
    gen = Generator(peft, max_seq_len=256, stop_ids=[])
    assert gen.adapters == ["default", "qv"]
    prompt = _prompt(15, seed=5)
    with peft.disable_adapter():
        ref_base = _hf_greedy(peft, prompt, 64)
    peft.set_adapter("default")
    ref_default = _hf_greedy(peft, prompt, 64)
    peft.set_adapter("qv")
    ref_qv = _hf_greedy(peft, prompt, 64)
    assert len({tuple(ref_base), tuple(ref_default), tuple(ref_qv)}) == 3  # the adapters matter
    for adapter, ref in ((None, ref_base), ("default", ref_default), ("qv", ref_qv), (None, ref_base)):
        assert gen.generate([prompt], 64, adapter=adapter).tokens[0] == ref, adapter
    # One batch, a different adapter per row: base and fine-tuned side by side.
    mixed = gen.generate([prompt, prompt, prompt], 64, adapter=["qv", None, "default"]).tokens
    assert mixed == [ref_qv, ref_base, ref_default]


def assert_updates_are_seen(peft, new_tokens: int, part: str = "") -> None:
    """A GRPO update between rollouts: adapter "default"'s B factors (those whose names hold
    `part` too) scaled by -3 in place; the same Generator then decodes HF's new greedy tokens."""
    gen = Generator(peft, max_seq_len=128, stop_ids=[])
    prompt = _prompt(10, seed=6)
    before = gen.generate([prompt], new_tokens, adapter="default").tokens[0]
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B.default" in name and part in name:
                p.mul_(-3.0)
    peft.set_adapter("default")
    after = gen.generate([prompt], new_tokens, adapter="default").tokens[0]
    assert after == _hf_greedy(peft, prompt, new_tokens)
    assert after != before


def test_adapter_updates_are_seen_without_rebuilding() -> None:
    """GRPO trains the adapter between rollouts: every request syncs the latest weights."""
    assert_updates_are_seen(_with_adapters(_model("llama")), 32)


def test_adapter_loaded_from_a_folder(tmp_path: Path) -> None:
    peft = _with_adapters(_model("qwen3"))
    peft.save_pretrained(tmp_path / "adapters")
    prompt = _prompt(11, seed=8)
    ref = _hf_greedy(peft, prompt, 32)  # active adapter: "default"
    with peft.disable_adapter():
        ref_base = _hf_greedy(peft, prompt, 32)
    gen = Generator(_model("qwen3"), max_seq_len=128, stop_ids=[])  # a fresh copy of the base
    gen.load_adapter(str(tmp_path / "adapters"), "sft")
    assert gen.adapters == ["sft"]
    assert gen.generate([prompt], 32, adapter="sft").tokens[0] == ref
    assert gen.generate([prompt], 32).tokens[0] == ref_base
