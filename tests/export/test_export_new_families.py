"""Export of the issue-26 families: image-text checkpoints (their language model's GGUF, checked
by llama.cpp, and the vision projector file of Gemma 3, Gemma 4, Qwen3.5 and Mistral 3, checked by
llama.cpp's mtmd; merged and adapter exports of the whole model) and a family without a GGUF layout
(a clear refusal; adapter and merged exports work)."""

from __future__ import annotations

import copy
import dataclasses
import json
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from kestrel.errors import KestrelError
from kestrel.export import ExportCheckError, export, mmproj
from kestrel.export.mmproj_families import PROJECTORS as MMPROJ
from kestrel.model.multimodal import lora_targets
from kestrel.model.registry import FAMILIES, GGUF_FAMILIES, SUPPORTED
from tests.support.export_fixtures import save_tiny_image_text_model, save_tiny_model, train_tokenizer
from tests.support.tiny_image_text import IMAGE_TEXT

STYLE = {"gemma3": "gemma", "mistral3": "mistral", "qwen3_5": "qwen2", "qwen3_5_moe": "qwen2", "gemma4": "gemma4"}
NO_GGUF = [f for f in SUPPORTED if f not in GGUF_FAMILIES]


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {style: train_tokenizer(style, 600) for style in set(STYLE.values())}


def _adapter(model_dir: Path, out: Path, image_text: bool) -> Path:
    """A LoRA adapter with random B (so it changes the output) saved next to its base."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32)
    targets = lora_targets(model, ["q_proj", "v_proj", "down_proj"])
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", [k for k, (family, _, _) in IMAGE_TEXT.items() if family in GGUF_FAMILIES])
def test_image_text_gguf_holds_the_language_model(kind: str, tokenizers: dict, tmp_path: Path) -> None:
    folder = save_tiny_image_text_model(kind, tokenizers[STYLE[kind]], tmp_path / kind)
    adapter = _adapter(folder, tmp_path / "adapter", image_text=True)
    result = export(adapter, "gguf", tmp_path / "out", quant="f16")
    f16 = result.checks["gguf_f16"]
    assert result.passed and f16.passed and f16.exact_required and f16.prompt_top1_agreement == 1.0, result.summary()
    reader = gguf.GGUFReader(next(p for p in (tmp_path / "out").glob("*.gguf") if "mmproj" not in p.name))
    names = [t.name for t in reader.tensors]
    assert "token_embd.weight" in names and any(n.startswith("blk.1.ffn_down") for n in names)  # ffn_down_exps: MoE
    assert not any("vision" in n or "mm" in n or "v.blk" in n for n in names)
    if kind == "mistral3":  # the test tokenizer has no [IMG_BREAK], which llama.cpp's pixtral projector needs
        assert "mmproj" not in result.checks and not list((tmp_path / "out").glob("*mmproj*"))
        assert any(n.startswith("no projector file: llama.cpp's pixtral projector needs") for n in result.notes)
    else:  # its layout is tested by `test_<kind>_projector_file_loads_in_mtmd`
        assert result.checks["mmproj"]["passed"]


def _projector_file(model_dir: Path, tmp_path: Path, n_tokens: int, quant: str = "f16") -> tuple[dict, dict]:
    """Export `model_dir` to GGUF: the projector check passed, an image encoded as `n_tokens` tokens
    within its tolerance; returns the projector file's metadata fields and its tensors by name."""
    result = export(model_dir, "gguf", tmp_path / "out", quant=quant)
    found = result.checks["mmproj"]
    assert result.passed and found["passed"] and found["file"] == f"{model_dir.name}-mmproj-f16.gguf", (
        found, result.summary())
    assert found["n_tokens"] == n_tokens and found["max_error"] <= found["tolerance"], found
    reader = gguf.GGUFReader(tmp_path / "out" / found["file"])
    return {k: reader.fields[k].contents() for k in reader.fields}, {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizers: dict) -> Path:
    return save_tiny_image_text_model("gemma3", tokenizers["gemma"], tmp_path_factory.mktemp("gemma3"))


def test_gemma3_projector_file_loads_in_mtmd(gemma3_dir: Path, tmp_path: Path) -> None:
    fields, tensors = _projector_file(gemma3_dir, tmp_path, 4, quant="q8_0")  # an image encoded as HF encodes it
    assert fields["general.architecture"] == "clip" and fields["clip.projector_type"] == "gemma3"
    assert fields["clip.vision.projection_dim"] == 128 and fields["clip.vision.block_count"] == 1
    assert fields["clip.vision.projector.scale_factor"] == 2  # 4x4 patches pooled to mm_tokens_per_image = 4
    assert tensors["v.patch_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["mm.input_projection.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert "v.blk.0.attn_q.weight" in tensors and not any("head" in n for n in tensors)
    from safetensors import safe_open

    with safe_open(gemma3_dir / "model.safetensors", "pt") as f:
        norm = f.get_tensor("multi_modal_projector.mm_soft_emb_norm.weight").numpy()
    assert np.allclose(tensors["mm.soft_emb_norm.weight"].data, norm + 1)  # Gemma's (1 + w)


def test_image_text_family_without_a_projector_layout_says_so(gemma3_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(MMPROJ, "gemma3")
    result = export(gemma3_dir, "gguf", tmp_path / "out", quant="f16")
    assert result.passed and "mmproj" not in result.checks
    assert any("vision tower is not exported" in n for n in result.notes)


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory, tokenizers: dict) -> Path:
    return save_tiny_image_text_model("gemma4", tokenizers["gemma4"], tmp_path_factory.mktemp("gemma4"))


def test_gemma4_projector_file_loads_in_mtmd(gemma4_dir: Path, tmp_path: Path) -> None:
    fields, tensors = _projector_file(gemma4_dir, tmp_path, 81)  # 27 x 27 patches pooled by 3
    assert fields["clip.vision.projector_type"] == "gemma4v" and "clip.projector_type" not in fields
    assert fields["clip.vision.image_mean"] == [0.0] * 3 and fields["clip.vision.image_std"] == [1.0] * 3
    assert "clip.vision.projector.scale_factor" not in fields  # pooling_kernel_size 3: clip's default
    assert tensors["v.position_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert list(tensors["v.patch_embd.weight"].shape) == [8, 8, 3, 32]  # ggml order of the (32, 3, 8, 8) conv
    assert {"mm.input_projection.weight", "v.blk.0.attn_q_norm.weight", "v.blk.0.ffn_gate.weight"} <= set(tensors)


def _clipped_gemma4(tokenizer: object, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny Gemma 4 whose vision linears clip their inputs and outputs to [-0.5, 0.5] (ranges that bind)
    and whose pooled features are standardized (random bias and scale)."""
    from safetensors.torch import load_file, save_file

    family, vision, extra = IMAGE_TEXT["gemma4"]
    monkeypatch.setitem(IMAGE_TEXT, "gemma4", (family, {**vision, "use_clipped_linears": True, "standardize": True}, extra))
    save_tiny_image_text_model("gemma4", tokenizer, folder)
    tensors, gen = load_file(folder / "model.safetensors"), torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith(("_max", "_min")):
            t.fill_(0.5 if name.endswith("_max") else -0.5)
        elif name.endswith(("std_scale", "std_bias")):
            t.copy_(torch.rand(t.shape, generator=gen) + (0.5 if name.endswith("scale") else -0.5))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("ranges", ["written", "left out"])
def test_gemma4_clipped_linears_and_standardize(ranges: str, tokenizers: dict, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _clipped_gemma4(tokenizers["gemma4"], tmp_path / "gemma4", monkeypatch)
    if ranges == "left out":  # clip then multiplies unclipped: the image embeddings differ
        good = MMPROJ["gemma4"]
        monkeypatch.setitem(MMPROJ, "gemma4", dataclasses.replace(
            good, source_name=lambda n: None if n.endswith(("_max", "_min")) else good.source_name(n)))
        with pytest.raises(ExportCheckError, match="check mmproj: passed=False, file=[^;]*max_error"):
            export(folder, "gguf", tmp_path / "out", quant="f16")
        return
    result = export(folder, "gguf", tmp_path / "out", quant="f16")
    assert result.passed and result.checks["mmproj"]["passed"], result.summary()
    names = [t.name for t in gguf.GGUFReader(tmp_path / "out" / f"{folder.name}-mmproj-f16.gguf").tensors]
    assert {"v.std_bias", "v.std_scale", "v.blk.0.attn_q.input_max", "v.blk.0.ffn_down.output_min"} <= set(names)


@pytest.fixture  # not module-wide: building it runs HF's Qwen3.5, which the suite's per-test fixture keeps on PyTorch
def qwen3_5_dir(tmp_path: Path, tokenizers: dict) -> Path:
    return save_tiny_image_text_model("qwen3_5", tokenizers["qwen2"], tmp_path / "qwen3_5")


def test_qwen3_5_projector_file_loads_in_mtmd(qwen3_5_dir: Path, tmp_path: Path) -> None:
    fields, tensors = _projector_file(qwen3_5_dir, tmp_path, 576)  # 48 x 48 patches merged 2 x 2
    assert fields["clip.projector_type"] == "qwen3vl_merger" and fields["clip.vision.spatial_merge_size"] == 2
    assert fields["clip.vision.image_size"] == 384 and fields["clip.vision.block_count"] == 1
    assert list(tensors["v.patch_embd.weight.1"].shape) == [8, 8, 3, 32]  # the Conv3d's second frame
    assert {"v.patch_embd.weight", "v.post_ln.weight", "mm.0.weight", "mm.2.bias", "v.blk.0.attn_qkv.weight"} <= set(tensors)


def test_image_stats_read_processor_config_then_the_family_default(tmp_path: Path) -> None:
    config = types.SimpleNamespace(model_type="gemma4")
    assert mmproj.image_stats(tmp_path, config) == ([0.0] * 3, [1.0] * 3)  # Gemma 4 normalises nothing
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"image_mean": [0.1] * 3,
                                                                                    "image_std": [0.2] * 3}}))
    assert mmproj.image_stats(tmp_path, config) == ([0.1] * 3, [0.2] * 3)  # newer checkpoints nest it there


@pytest.fixture
def mistral3_dir(tmp_path: Path, tokenizers: dict) -> Path:
    tokenizer = copy.deepcopy(tokenizers["mistral"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG_BREAK]"]})  # as Mistral 3's tokenizers have
    folder = save_tiny_image_text_model("mistral3", tokenizer, tmp_path / "mistral3")
    _sharpen_vision_attention(folder, 30.0)
    return folder


def _sharpen_vision_attention(folder: Path, scale: float) -> None:
    """Scale the tower's q and k (sharper attention) and v and o (a larger share in the output): with
    random initial values attention is near-uniform and small, and positions (the rotary layout the
    file must get right) barely move the output."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name, t in tensors.items():
        if "vision" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
            t.mul_(scale)
        elif "vision" in name and name.endswith(("v_proj.weight", "o_proj.weight")):
            t.mul_(scale ** 0.5)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_mistral3_projector_file_loads_in_mtmd(mistral3_dir: Path, tmp_path: Path) -> None:
    fields, tensors = _projector_file(mistral3_dir, tmp_path, 19)  # 4 rows of 4, 3 [IMG_BREAK]s
    assert fields["clip.projector_type"] == "pixtral" and fields["clip.vision.spatial_merge_size"] == 2
    assert {"v.token_embd.img_break", "mm.patch_merger.weight", "mm.input_norm.weight", "mm.1.weight", "mm.2.weight"} <= set(tensors)


def _drop_projector(p: mmproj.Projector) -> mmproj.Projector:
    return dataclasses.replace(p, source_name=lambda n: None if any(k in n for k in ("projector", "projection", "merger"))
                               else p.source_name(n))


def _swap_q_k(p: mmproj.Projector) -> mmproj.Projector:
    swap = {"q_proj": "k_proj", "k_proj": "q_proj"}
    return dataclasses.replace(p, source_name=lambda n: p.source_name(
        next((n.replace(a, b) for a, b in swap.items() if a in n), n)))


def _swap_merger_layers(p: mmproj.Projector) -> mmproj.Projector:
    swap = {"mm.0": "mm.2", "mm.2": "mm.0"}
    return dataclasses.replace(p, renames={k: swap.get(v, v) for k, v in p.renames.items()})


def _one_frame_kernel(p: mmproj.Projector) -> mmproj.Projector:
    """Both frames' kernels from the first frame: the Conv3d's time axis handled wrong."""
    return dataclasses.replace(p, splits={k: (lambda w, fn=fn: {n: np.ascontiguousarray(w[:, :, 0]) for n in fn(w)})
                                          for k, fn in p.splits.items()})


_BREAKS = {  # how a layout goes wrong: mtmd refuses the file, or loads it and encodes images differently
    "no projector tensors": _drop_projector,
    "no transforms": lambda p: dataclasses.replace(p, transforms={}),  # Gemma 4's: clip aborts on the 2-D patch weight
    # Gemma 3's norm without (1 + w); Gemma 4's patch weight reshaped to the conv's shape but not permuted
    "transforms keep shapes only": lambda p: dataclasses.replace(
        p, transforms={k: (lambda w, v, fn=fn: w.reshape(fn(w, v).shape)) for k, fn in p.transforms.items()}),
    "q and k misnamed": _swap_q_k,
    "merger layers misnamed": _swap_merger_layers,  # Qwen3.5's fc1 and fc2 (same shapes in the tiny tower)
    "one frame's kernel for both": _one_frame_kernel,
}


_WRONG = [(kind, wrong) for kind in ("gemma3", "gemma4") for wrong in list(_BREAKS)[:4]] + [
    ("qwen3_5", "no projector tensors"), ("qwen3_5", "merger layers misnamed"), ("qwen3_5", "one frame's kernel for both"),
    ("mistral3", "no projector tensors"), ("mistral3", "no transforms")]  # Mistral 3's: q/k rows in rotate-half order


@pytest.mark.parametrize("kind,wrong", _WRONG)
def test_a_wrong_projector_file_fails_the_check(kind: str, wrong: str, request: pytest.FixtureRequest, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    folder = request.getfixturevalue(f"{kind}_dir")
    monkeypatch.setitem(MMPROJ, kind, _BREAKS[wrong](MMPROJ[kind]))
    with pytest.raises(ExportCheckError, match="check mmproj: passed=False"):
        export(folder, "gguf", tmp_path / "out", quant="f16")


@pytest.mark.parametrize("kind,quant", [("gemma3", "q8_0"), ("mistral3", "q4_k_m")])
def test_image_text_quantized_gguf_answers(kind: str, quant: str, tokenizers: dict, tmp_path: Path) -> None:
    folder = save_tiny_image_text_model(kind, tokenizers[STYLE[kind]], tmp_path / kind)
    result = export(folder, "gguf", tmp_path / "out", quant=quant)
    check = result.checks[f"gguf_{quant}"]
    assert result.passed and check.passed and check.top1_agreement >= 0.6, result.summary()
    assert result.checks["chat_template"]["jinja_matches"]
    stops = {"gemma3": ["<end_of_turn>", "<eos>"], "mistral3": ["</s>"]}[kind]
    assert result.checks["modelfile"]["stops"] == stops
    assert all(f'PARAMETER stop "{stop}"' in (tmp_path / "out" / "Modelfile").read_text() for stop in stops)


_MERGED_KINDS = list(IMAGE_TEXT)  # Qwen3.5-MoE among them: its expert sizes live in text_config


@pytest.mark.parametrize("kind", _MERGED_KINDS)
def test_image_text_merged_export_keeps_the_whole_model(kind: str, tokenizers: dict, tmp_path: Path) -> None:
    folder = save_tiny_image_text_model(kind, tokenizers[STYLE[kind]], tmp_path / kind)
    adapter = _adapter(folder, tmp_path / "adapter", image_text=True)
    result = export(adapter, "merged", tmp_path / "merged", quant="f32")
    assert result.passed and result.checks["merged"]["passed"], result.summary()
    from safetensors import safe_open

    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as f, safe_open(folder / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())  # the vision tower too, under the checkpoint's own names


# Families without a GGUF layout are refused; with none left, one is marked without.
@pytest.mark.parametrize("family", NO_GGUF or ["qwen3_5_text"])
def test_dense_family_without_a_gguf_layout_says_so_and_exports_merged(family: str, tokenizers: dict, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if family in GGUF_FAMILIES:
        monkeypatch.setitem(FAMILIES, family, dataclasses.replace(FAMILIES[family], gguf=False))
    folder = save_tiny_model(family, tokenizers["qwen2"], tmp_path / family)
    with pytest.raises(KestrelError, match=f"GGUF export of {family} models .* Export `merged`"):
        export(folder, "gguf", tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()
    adapter = _adapter(folder, tmp_path / "adapter", image_text=False)
    assert export(adapter, "adapter", tmp_path / "adapter-out").passed
    merged = export(adapter, "merged", tmp_path / "merged", quant="f32")
    assert merged.passed and merged.checks["merged"]["passed"], merged.summary()


@pytest.mark.parametrize("kind", [k for k, (family, _, _) in IMAGE_TEXT.items() if family not in GGUF_FAMILIES] or ["qwen3_5"])
def test_image_text_family_without_a_gguf_layout_says_so(kind: str, tokenizers: dict, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    family = IMAGE_TEXT[kind][0]
    if family in GGUF_FAMILIES:  # every image-text family has a layout now: one is marked without
        monkeypatch.setitem(FAMILIES, family, dataclasses.replace(FAMILIES[family], gguf=False))
    folder = save_tiny_image_text_model(kind, tokenizers[STYLE[kind]], tmp_path / kind)
    with pytest.raises(KestrelError, match=f"GGUF export of {family} models .* Export `merged`"):
        export(folder, "gguf", tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()
