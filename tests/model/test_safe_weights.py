"""Pickled weights are refused by default (issue 30, item 8): a model folder with
`pytorch_model.bin`, an adapter with `adapter_model.bin`, at load, at submit and at export, with a
message giving the conversion command (never `weights_only=False`); `python -m kestrel convert`
turns them into safetensors that load to the same weights, and refuses a pickle that is more than
tensors without running it."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from kestrel.cli import main as cli_main
from kestrel.errors import KestrelError, ModelLoadError
from kestrel.model.loader import load

REFUSAL = "python -m kestrel convert"


def _pickled_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    from safetensors.torch import load_file

    state = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    torch.save(state, dst / "pytorch_model.bin")
    return dst


def _no_torch_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was called on a user's weights")

    monkeypatch.setattr(torch, "load", refuse)


def _refused(excinfo: pytest.ExceptionInfo[BaseException], name: str) -> None:
    text = str(excinfo.value)
    assert name in text and REFUSAL in text and "weights_only" not in text, text


def test_a_pickled_model_is_refused_then_converted(tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = _pickled_model(tiny_model_dir("llama"), tmp_path / "old-llama")
    with monkeypatch.context() as m:
        _no_torch_load(m)
        with pytest.raises(ModelLoadError) as excinfo:
            load(str(folder), device="cpu", patch=False)
        _refused(excinfo, "pytorch_model.bin")
        from kestrel.jobs.preflight import check_model

        with pytest.raises(ModelLoadError) as excinfo:  # refused at submit, not in the worker
            check_model(str(folder))
        _refused(excinfo, "pytorch_model.bin")
        from kestrel.export import export

        with pytest.raises(KestrelError) as excinfo:
            export(str(folder), "merged", str(tmp_path / "out"), check=False)
        _refused(excinfo, "pytorch_model.bin")
    assert cli_main(["convert", str(folder)]) == 0
    assert capsys.readouterr().out.strip() == str(folder / "model.safetensors")
    converted, _ = load(str(folder), device="cpu", patch=False)
    original, _ = load(str(tiny_model_dir("llama")), device="cpu", patch=False)
    for (name, a), (_, b) in zip(original.state_dict().items(), converted.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_pickled_adapter_is_refused_then_converted(tiny_model_dir, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import LoraConfig, get_peft_model

    from kestrel.config import LoraSettings
    from kestrel.decode.adapters import load_adapter
    from kestrel.model.lora import attach_lora

    base, _ = load(str(tiny_model_dir("llama")), device="cpu", patch=False)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter", safe_serialization=False)
    folder = tmp_path / "adapter"
    assert (folder / "adapter_model.bin").is_file() and not (folder / "adapter_model.safetensors").exists()
    base = peft_model.unload()
    with monkeypatch.context() as m:
        _no_torch_load(m)
        with pytest.raises(ModelLoadError) as excinfo:
            load_adapter(base, folder)
        _refused(excinfo, "adapter_model.bin")
        with pytest.raises(ModelLoadError) as excinfo:
            attach_lora(base, LoraSettings(r=4, targets=["q_proj"], init_from=str(folder)))
        _refused(excinfo, "adapter_model.bin")
    assert cli_main(["convert", str(folder)]) == 0
    assert (folder / "adapter_model.safetensors").is_file()
    assert load_adapter(base, folder).peft_config["default"].r == 4


class _Payload:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("content, words", [
    ({"a": _Payload()}, "it holds more than weights"),
    ({"step": 3, "note": "x"}, "not a plain mapping of names to tensors"),
])
def test_convert_refuses_a_pickle_that_is_more_than_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch, content: dict,
                                                            words: str) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save(content, tmp_path / "pytorch_model.bin")
    assert cli_main(["convert", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "weights_only" not in err, err
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "model.safetensors").exists()


def test_safetensors_beside_a_pickle_is_fine_and_other_bins_are_not_weights(tmp_path: Path) -> None:
    from kestrel.model.safe_weights import pickled_weights

    (tmp_path / "training_args.bin").write_bytes(b"x")
    (tmp_path / "optimizer.pt").write_bytes(b"x")
    assert pickled_weights(tmp_path) == []
    (tmp_path / "pytorch_model-00001-of-00002.bin").write_bytes(b"x")
    assert [p.name for p in pickled_weights(tmp_path)] == ["pytorch_model-00001-of-00002.bin"]
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert pickled_weights(tmp_path) == []


def test_no_torch_load_of_user_weights_in_the_package() -> None:
    """Every torch.load in kestrel/ is either the conversion command or Kestrel's own optimizer
    and scheduler state (as saved on one device, and gathered from FSDP2's shards), always with
    the restricted loader."""
    root = Path(__file__).resolve().parents[2] / "kestrel"
    calls = {str(p.relative_to(root)): p.read_text().count("torch.load(") for p in root.rglob("*.py")}
    assert {k: v for k, v in calls.items() if v} == {"model/safe_weights.py": 1, "training/checkpoints.py": 4}
    for path in ("model/safe_weights.py", "training/checkpoints.py"):
        for call in re.findall(r"torch\.load\([^)]*\)", (root / path).read_text()):
            assert "weights_only=True" in call, (path, call)
