"""An adapter from a real (short) training run of the demo model, exported three ways through the
command line: the adapter, the merged model and a GGUF file all give the same answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.cli import main
from kestrel.config import config_from_dict
from kestrel.export import check as checks
from kestrel.export.source import resolve_source
from kestrel.training.run import run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "demo-lora"
    cfg = dict(model="demo", method="lora", dataset="arithmetic_chat", output_dir=str(out), max_seq_length=96,
               batch_size=4, max_steps=25, learning_rate=3e-3, save_steps=0, seed=0, gradient_checkpointing="off")
    result = run(config_from_dict(cfg))
    assert result.status == "completed", result.error
    return out


def _answers(model_dir: Path, adapter_dir: Path | None, tokenizer) -> list[list[int]]:
    model = checks.load_reference(model_dir, adapter_dir, "cpu")
    return [checks.greedy(model, ids, n_new=16).tokens for ids in checks.prompt_ids(tokenizer)]


def test_adapter_merged_and_gguf_give_the_same_answers(trained_run: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoTokenizer

    for fmt, extra in (("adapter", []), ("merged", []), ("gguf", ["--quant", "f16"])):
        assert main(["export", str(trained_run), "--format", fmt, "--out", str(tmp_path / fmt), *extra]) == 0
    printed = capsys.readouterr().out
    assert "export gguf f16: passed" in printed and f"wrote {tmp_path / 'gguf' / 'demo-lora-f16.gguf'}" in printed
    f16 = json.loads((tmp_path / "gguf" / "export.json").read_text())["checks"]["gguf_f16"]
    # Every generated token agrees, except where the fp32 reference's top two logits are within
    # TIE_TOL x their std (a model trained for 25 steps may have one): f16 rounding picks either.
    n = 3 * checks.N_NEW
    assert f16["passed"] and round(f16["top1_agreement"] * n) + f16["ties"] == n, f16

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    base_dir = resolve_source("demo").model_dir
    with_adapter = _answers(base_dir, tmp_path / "adapter", tokenizer)
    assert _answers(tmp_path / "merged", None, tokenizer) == with_adapter
    assert _answers(base_dir, None, tokenizer) != with_adapter  # training changed the answers
    text = tokenizer.decode(with_adapter[0])
    assert "The answer is" in text, text  # the training answers' wording, learned in 25 steps


def test_cli_reports_bad_input_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["export", str(tmp_path), "--format", "gguf", "--quant", "q9", "--out", str(tmp_path / "o")]) == 2
    assert "unknown quantization type 'q9'" in capsys.readouterr().err
