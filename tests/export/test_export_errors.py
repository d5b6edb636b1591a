"""Bad input to export: clear errors, and never a partial file left behind."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import yaml

from kestrel.errors import KestrelError
from kestrel.export import ExportCheckError, export, gguf_export
from kestrel.export.check import GGUFCheck
from tests.support.export_fixtures import save_tiny_model, train_tokenizer
from kestrel.export.quantize import QUANT_TYPES
from kestrel.export.source import resolve_source
from kestrel.model.registry import SUPPORTED


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", train_tokenizer("gpt2", 500), tmp_path_factory.mktemp("llama"))


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.rglob("*")) if out.exists() else []


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(folder)
    with pytest.raises(KestrelError) as err:
        export(folder, "gguf", tmp_path / "out")
    assert "'gpt2'" in str(err.value) and all(name in str(err.value) for name in SUPPORTED)
    assert not (tmp_path / "out").exists()


def test_unknown_quantization_lists_the_valid_ones(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(KestrelError) as err:
        export(llama_dir, "gguf", tmp_path / "out", quant="q3_x")
    assert "q3_x" in str(err.value) and all(q in str(err.value) for q in QUANT_TYPES)
    with pytest.raises(KestrelError, match="auto, bf16, f16, f32"):
        export(llama_dir, "merged", tmp_path / "out", quant="q4_k_m")
    with pytest.raises(KestrelError, match="adapter, merged, gguf"):
        export(llama_dir, "onnx", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt,quant", [("gguf", "f16"), ("gguf", "q4_k_m"), ("merged", None)])
def test_not_enough_disk_space_is_found_before_writing(fmt: str, quant: str | None, llama_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(KestrelError, match="not enough disk space"):
        export(llama_dir, fmt, tmp_path / "out", quant=quant)
    assert not (tmp_path / "out").exists()


def test_folder_without_weights(tmp_path: Path, llama_dir: Path) -> None:
    folder = tmp_path / "empty-model"
    folder.mkdir()
    shutil.copy(llama_dir / "config.json", folder / "config.json")
    with pytest.raises(KestrelError, match="no weights"):
        export(folder, "gguf", tmp_path / "out")
    with pytest.raises(KestrelError, match="neither a training output folder"):
        export(tmp_path, "gguf", tmp_path / "out")
    adapter = tmp_path / "run" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(llama_dir)}))
    with pytest.raises(KestrelError, match="no adapter_model.safetensors"):
        export(tmp_path / "run", "merged", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_adapter_format_needs_an_adapter(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(KestrelError, match="no adapter"):
        export(llama_dir, "adapter", tmp_path / "out")


def test_failed_check_removes_every_file(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("the user's own file")  # an existing folder keeps what it had
    monkeypatch.setattr(gguf_export.checks, "check_gguf",
                        lambda path, refs, exact, tie_tol=0.0: GGUFCheck(False, exact, 0.1, 0.1, problems=["differs"]))
    with pytest.raises(ExportCheckError, match="differs") as err:
        export(llama_dir, "gguf", out, quant="q4_k_m")
    assert err.value.result.files == [] and not err.value.result.passed
    assert _leftovers(out) == ["keep.txt"]


def test_a_crash_mid_write_removes_partial_files(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_quantize(src: Path, dst: Path, quant: str) -> None:
        dst.write_bytes(b"GGUF half a file")
        raise KestrelError("llama.cpp could not quantize")

    monkeypatch.setattr(gguf_export, "quantize", broken_quantize)
    with pytest.raises(KestrelError, match="could not quantize"):
        export(llama_dir, "gguf", tmp_path / "out", quant="q4_k_m", check=False)
    assert not (tmp_path / "out").exists()


def test_training_output_folders_resolve(llama_dir: Path, tmp_path: Path) -> None:
    full = tmp_path / "full-run"
    shutil.copytree(llama_dir, full / "model")
    (full / "config.yaml").write_text(yaml.safe_dump({"model": str(llama_dir), "method": "full"}))
    src = resolve_source(full)
    assert src.model_dir == full / "model" and src.adapter_dir is None and src.method == "full" and src.name == "full-run"
    demo = resolve_source("demo")
    assert demo.family.model_type == "llama" and demo.adapter_dir is None
