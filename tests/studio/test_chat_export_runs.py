"""Issue 29's Chat and Export items, on the handlers: runs with only a checkpoint are listed and
the newest run is followed, a run's weights are chosen (final or a checkpoint), a full fine-tune
answers side by side with its base in one batched decode, answers carry tokens/s, Stop settles
an answer that had not begun, the demo model's note, the export's checks and quantization hints.

Runs (built once for the module): #1 a completed LoRA run of the demo model with a checkpoint
of step 1 (its B negated: other answers), #2 a failed run that left only a checkpoint of step 2,
#3 a completed full fine-tune of the demo model (its weights perturbed)."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import gradio as gr
import pytest
import torch
from safetensors import safe_open
from sqlalchemy import update

from kestrel import jobs
from kestrel.export import ExportResult
from kestrel.export.quantize import BITS_PER_WEIGHT, QUANT_TYPES, QUANTS
from kestrel.jobs.models import Job
from kestrel.jobs.queries import record_artifact
from kestrel.jobs.store import reset_engines, session
from kestrel.studio import strings as S
from kestrel.studio.handlers import chat, export
from kestrel.studio.models import ModelPool
from kestrel.training.checkpoints import human_size
from tests.jobs.exportkit import checkpoint_in, completed_run, lora_run
from tests.studio.helpers import error_text

SHARED_HOME = True
GREEDY = dict(system="", temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, repetition_penalty=1.0, seed=None)


def _status(job_id: int, status: str) -> None:
    with session(immediate=True) as s:
        s.execute(update(Job).where(Job.id == job_id).values(status=status, finished_at=time.time()))


def _full_run(folder: Path) -> Path:
    """folder/model: the demo model with every weight nudged, as a full fine-tune saves it."""
    from kestrel.model.loader import load

    model, tokenizer = load("demo", 256, patch=False)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder


@pytest.fixture(scope="module")
def runs(module_home: Path) -> dict[str, int]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KESTREL_HOME", str(module_home))
        reset_engines()
        lora = lora_run(module_home / "runs" / "lora")
        checkpoint_in(lora, 1, -1.0)
        first = completed_run(lora, "lora")
        partial = module_home / "runs" / "partial"
        partial.mkdir(parents=True)
        shutil.copytree(lora / "adapter", partial / "source-adapter")
        (partial / "adapter").mkdir()  # training died before its final weights: an empty folder
        shutil.move(partial / "source-adapter", partial / "checkpoints" / "step-000002" / "adapter")
        (partial / "checkpoints" / "step-000002" / "state.json").write_text('{"step": 2}')
        second = jobs.submit({"model": "demo", "dataset": "arithmetic_chat", "max_steps": 3, "name": "partial",
                              "output_dir": str(partial)}, start=False)
        _status(second, "failed")
        third = completed_run(_full_run(module_home / "runs" / "full"), "full")
        reset_engines()
    return {"lora": first, "partial": second, "full": third}


@pytest.fixture(scope="module")
def pool() -> ModelPool:
    return ModelPool(capacity=2)


def _answer(pool: ModelPool, target: str, checkpoint: str | None, side: bool = False) -> dict:
    return list(chat.respond(pool, "What is 2 + 3?", [], [], target, checkpoint, side, **GREEDY))[-1]


def test_runs_with_a_checkpoint_are_listed_and_the_newest_is_followed(runs: dict[str, int]) -> None:
    ids = [runs["full"], runs["partial"], runs["lora"]]
    assert [v for _, v in chat.target_choices()][:3] == [f"run:{i}" for i in ids]
    assert [v for _, v in export.source_choices()] == [f"run:{i}" for i in ids] + ["base:demo"]
    # A page that loaded before these runs existed (or before the newest) switches to the newest...
    for refresh, key in ((chat.refresh_targets, "target"), (export.refresh_sources, "source")):
        out = refresh("base:demo", runs["lora"])
        assert out[key]["value"] == f"run:{runs['full']}" and out["seen"] == runs["full"]
        assert refresh(None, None)[key]["value"] == f"run:{runs['full']}"
        # ...but keeps what the user picked once it has seen the newest run.
        assert refresh("base:demo", runs["full"])[key]["value"] == "base:demo"


def test_opening_a_tab_describes_the_choice_it_shows(runs: dict[str, int]) -> None:
    """Tab open and Refresh answer with the list and what its choice shows, in one answer."""
    newest, lora = f"run:{runs['full']}", f"run:{runs['lora']}"
    shown = chat.show_targets("base:demo", runs["lora"], None, True)  # a newer run appeared
    assert shown["target"]["value"] == newest and shown["checkpoint"]["visible"] is True
    assert shown["right"]["visible"] is True and shown["right"]["label"].startswith(f"Run #{runs['full']}")
    # The same choice: the conversation stays (no panels in the answer), the weights' list is re-read.
    kept = chat.show_targets(lora, runs["full"], "1", False)
    assert kept["target"]["value"] == lora and not {"left", "right", "note"} & set(kept)
    assert kept["checkpoint"]["value"] == "1" and len(kept["checkpoint"]["choices"]) == 2
    base = chat.show_targets(None, runs["full"], None, False)  # a fresh page that has seen every run
    assert base["target"]["value"] == newest and base["note"]["visible"] is True  # the demo's runs carry the note
    picked = export.show_sources("base:demo", runs["lora"], None, "gguf", None)
    assert picked["source"]["value"] == newest and picked["checkpoint"]["visible"] is True
    assert picked["quant"]["value"] == "q4_k_m" and "about" in picked["quant"]["choices"][0][0]
    demo = export.show_sources("base:demo", runs["full"], "final", "adapter", None)
    assert demo["source"]["value"] == "base:demo" and demo["checkpoint"]["visible"] is False
    assert demo["quant"]["visible"] is False


def test_a_run_is_chatted_with_at_a_checkpoint(runs: dict[str, int], pool: ModelPool) -> None:
    target = f"run:{runs['lora']}"
    shown = chat.describe_target(target, None, False)
    assert shown["checkpoint"]["choices"] == [(S.WEIGHTS_FINAL, "final"), (S.WEIGHTS_STEP.format(step=1), "1")]
    assert shown["checkpoint"]["value"] == "final" and shown["checkpoint"]["visible"] is True
    assert chat.describe_target(target, "1", True)["right"]["label"].endswith("· step 1")
    final = _answer(pool, target, "final")["left"][-1]["content"]
    step1 = _answer(pool, target, "1")["left"][-1]["content"]
    base = _answer(pool, "base:demo", None)["left"][-1]["content"]
    assert len({final, step1, base}) == 3  # the checkpoint's adapter, not the final one, answered
    # A run with only a checkpoint: that checkpoint is the default.
    partial = chat.describe_target(f"run:{runs['partial']}", None, False)["checkpoint"]
    assert partial["choices"] == [(S.WEIGHTS_STEP.format(step=2), "2")] and partial["value"] == "2"
    assert _answer(pool, f"run:{runs['partial']}", None)["left"][-1]["content"] == final  # same adapter
    with pytest.raises(gr.Error) as excinfo:
        list(chat.respond(pool, "hi", [], [], target, "7", False, **GREEDY))
    assert "no checkpoint of step 7" in error_text(excinfo) and "checkpoints kept: 1" in error_text(excinfo)


def test_a_full_fine_tune_answers_beside_its_base_in_one_batched_decode(runs: dict[str, int], pool: ModelPool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.decode import Generator

    target = f"run:{runs['full']}"
    base = _answer(pool, "base:demo", None)["left"][-1]["content"]
    tuned = _answer(pool, target, None)["left"][-1]["content"]
    assert base != tuned
    loops = []
    chunks = Generator.chunks
    monkeypatch.setattr(Generator, "chunks", lambda self, prompts, *a, **k: loops.append(len(prompts))
                        or chunks(self, prompts, *a, **k))
    both = _answer(pool, target, None, side=True)
    assert loops == [2]  # one decode loop of two rows, not two loops one after the other
    assert both["left"][-1]["content"] == base and both["right"][-1]["content"] == tuned
    # Models whose tokenizers differ cannot share a loop: one after the other, both stats kept.
    monkeypatch.setattr(ModelPool, "pair", lambda self, models: None)
    apart = _answer(pool, target, None, side=True)
    assert loops == [2, 1, 1] and len(apart["stats"].split("  \n")) == 2
    assert apart["left"][-1]["content"] == base and apart["right"][-1]["content"] == tuned


def test_each_answer_shows_its_tokens_per_second(runs: dict[str, int], pool: ModelPool) -> None:
    out = _answer(pool, f"run:{runs['lora']}", None, side=True)
    lines = out["stats"].split("  \n")
    assert len(lines) == 2 and lines[0].startswith("**Base: demo**") and lines[1].startswith(f"**Run #{runs['lora']}")
    for line in lines:
        tokens, rate = int(line.split("**: ")[1].split(" tokens")[0]), float(line.split(" · ")[1].split(" tokens/s")[0])
        assert 0 < tokens <= GREEDY["max_new_tokens"] and rate > 0


def test_stop_settles_an_answer_that_had_not_begun() -> None:
    asked = {"role": "user", "content": "hi"}
    loading = [asked, {"role": "assistant", "content": S.CH_LOADING.format(model="/some/model")}]
    begun = [asked, {"role": "assistant", "content": "Hel"}]
    out = chat.stopped(begun, loading)
    assert out["right"] == [asked, {"role": "assistant", "content": S.CH_STOPPED}]
    assert out["left"] is not None and not isinstance(out["left"], list)  # a begun answer stays as it is
    assert chat.stopped([asked, {"role": "assistant", "content": ""}], None)["left"][-1]["content"] == S.CH_STOPPED


def test_the_demo_model_says_its_answers_are_gibberish(runs: dict[str, int], tiny_model_dir, kestrel_home) -> None:
    note = chat.describe_target("base:demo", None, False)["note"]
    assert note["visible"] is True and "random weights" in note["value"] and "gibberish" in note["value"]
    assert "trained from the built-in demo model" in chat.describe_target(f"run:{runs['lora']}", None, True)["note"]["value"]
    other = kestrel_home / "models" / "tiny-llama"  # the studio reads local models inside KESTREL_HOME only
    if not other.exists():
        shutil.copytree(tiny_model_dir("llama"), other)
    assert chat.describe_target(f"base:{other}", None, False)["note"]["visible"] is False


def _demo_parameters() -> int:
    from kestrel.model.loader import demo_model_dir

    with safe_open(demo_model_dir() / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def test_quantization_list_gives_size_and_quality(runs: dict[str, int]) -> None:
    n = _demo_parameters()
    picked = export.pick_source(f"run:{runs['lora']}", None, "gguf", None)
    assert picked["checkpoint"]["value"] == "final" and picked["checkpoint"]["visible"] is True
    labels = dict((v, label) for label, v in picked["quant"]["choices"])
    assert list(labels) == list(QUANT_TYPES) and picked["quant"]["value"] == "q4_k_m"
    # The demo's MLP rows (688) do not fill k-quant blocks of 256: quantized sizes are upper bounds.
    for quant, label in labels.items():
        size = (f"about {human_size(int(n * QUANTS[quant].bits / 8))}" if quant in ("f32", "f16", "bf16") else
                f"up to {human_size(int(n * BITS_PER_WEIGHT[quant] / 8))}")
        assert label == f"{quant} · {size} · {QUANTS[quant].quality}"
    assert "upper bounds" in picked["quant"]["info"] and f"{n:,} weights" in picked["quant"]["info"]
    assert labels["f16"].split(" · ")[1] == f"about {human_size(2 * n)}"
    # A model whose rows fill the blocks gets each type's typical size.
    wide = export.quant_label("q4_k_m", (8_000_000_000, True))
    assert wide == f"q4_k_m · about {human_size(8e9 * 4.9 / 8)} · {QUANTS['q4_k_m'].quality}"
    assert export.pick_source("base:demo", None, "merged", "bf16")["quant"]["value"] == "bf16"
    assert export.pick_source("base:demo", None, "adapter", None)["checkpoint"]["visible"] is False


def test_every_gguf_type_has_bits_and_a_quality_note() -> None:
    assert set(QUANTS) == set(QUANT_TYPES)
    assert all(q.quality and 1.0 < q.bits <= 32.0 for q in QUANTS.values())


def test_a_finished_export_shows_its_checks(runs: dict[str, int]) -> None:
    job_id = jobs.submit(export.export_config(f"run:{runs['lora']}", "gguf", "q8_0"), start=False)
    out = Path(jobs.get_job(job_id).output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = ExportResult("gguf", out, "q8_0", passed=True, notes=["a note"], checks={
        "tokenizer": {"passed": True, "model": "gpt2"},
        "gguf_q8_0": {"passed": True, "top1_agreement": 0.96875, "problems": []},
        "modelfile": {"chat_format": "chatml"}})
    (out / "export.json").write_text(json.dumps(result.to_dict()))
    record_artifact(job_id, "report", out / "export.json")
    _status(job_id, "completed")
    status = export.export_view(job_id)["status"]
    assert S.EX_CHECKS in status and "- a note" in status
    assert "- tokenizer: **passed** · model=gpt2" in status
    assert "- gguf_q8_0: **passed** · top1_agreement=0.969" in status
    assert "- modelfile: chat_format=chatml" in status


def test_a_checkpoint_is_exported(runs: dict[str, int]) -> None:
    from kestrel.export.formats import size_basis

    config = export.export_config(f"run:{runs['partial']}", "adapter", None, "2")
    job = jobs.get_job(jobs.submit(config, start=False))
    assert job.config["source"].endswith("partial/checkpoints/step-000002") and job.name == f"run-{runs['partial']}-step2-adapter"
    assert size_basis(job.config["source"]) == (_demo_parameters(), False)  # the engine reads the checkpoint
    jobs.cancel(job.id)
    with pytest.raises(gr.Error) as excinfo:  # the failed run's final weights do not exist
        list(export.run_export(f"run:{runs['partial']}", "final", "adapter", None))
    assert "only completed runs" in error_text(excinfo)
    with pytest.raises(gr.Error) as excinfo:
        list(export.run_export(f"run:{runs['lora']}", "5", "adapter", None))
    assert "no complete checkpoint of step 5" in error_text(excinfo) and "kept: 1" in error_text(excinfo)


def test_the_train_form_offers_finished_full_models_to_train_further(runs: dict[str, int], module_home: Path) -> None:
    from kestrel.studio.handlers import train, weights

    full = str(module_home / "runs" / "full" / "model")
    assert weights.model_folders() == [(S.TR_MODEL_RUN.format(job=runs["full"], name=jobs.get_job(runs["full"]).name),
                                        full)]  # the LoRA and partial runs saved adapters, not models
    box = weights.model_box("local")
    assert box["visible"] and box["choices"] == weights.model_folders() and box["info"] == S.TR_MODEL_LOCAL_INFO
    assert weights.model_box("hub")["choices"] == [] and not weights.model_box("demo")["visible"]
    picked = train.form_to_config({"model_source": "local", "model": full, "method": "dpo"})
    assert picked["model"] == full


def test_the_best_weights_are_listed_from_the_store_first_and_exported_as_listed(runs: dict[str, int]) -> None:
    """A run with best/ (its adapter's B negated: other weights than the final ones): listed once
    the store records it, as the default, and each choice exports the weights it names."""
    from kestrel.export.source import resolve_source
    from kestrel.studio.handlers.weights import checkpoint_choices, weights_of

    lora = Path(jobs.get_job(runs["lora"]).output_dir)
    folder = lora.parent / "with-best"
    shutil.copytree(lora, folder, ignore=shutil.ignore_patterns("checkpoints"))
    checkpoint_in(folder, 3, -1.0)
    (folder / "best").mkdir()
    shutil.move(folder / "checkpoints" / "step-000003" / "adapter", folder / "best" / "adapter")
    shutil.rmtree(folder / "checkpoints")
    (folder / "best" / "best.json").write_text(json.dumps({"step": 3, "metric": "eval_loss", "value": 0.25}))
    job = jobs.get_job(completed_run(folder, "with-best"))
    assert [v for _, v in checkpoint_choices(job)] == ["final"]  # not recorded in the store: not listed
    record_artifact(job.id, "best", folder / "best", 3)
    choices = checkpoint_choices(job)
    assert choices[0] == ("Best weights: eval_loss 0.2500 at step 3", "best") and [v for _, v in choices] == ["best", "final"]
    assert weights_of(job, None).adapter == folder / "best" / "adapter"  # the default is the first listed
    target = chat.resolve_target(f"run:{job.id}", "best")
    assert target.adapter == str(folder / "best" / "adapter") and target.label.endswith("(best weights)")
    for choice, want in (("best", folder / "best" / "adapter"), ("final", folder / "adapter")):
        config = export.export_config(f"run:{job.id}", "adapter", None, choice)
        exported = jobs.get_job(jobs.submit(config, start=False))
        assert resolve_source(exported.config["source"]).adapter_dir == want, choice
        jobs.cancel(exported.id)
