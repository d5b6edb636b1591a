"""Chat tab handlers: pick the base model or a finished run, stream answers through the engine's
decode path, optionally base and fine-tuned side by side on the same prompt.

Targets are strings: `base:<model>` or `run:<job id>`. Histories are Gradio's message dicts
(`{"role", "content"}`), one per chat panel, owned by the browser.

    for out in respond(pool, "What is 2 + 3?", [], [], "run:3", True, "", 0.0, 1.0, 0, 64, 1.0, None):
        out["left"], out["right"]    # base and fine-tuned conversations so far
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from kestrel import jobs
from kestrel.errors import KestrelError
from kestrel.studio import strings as S
from kestrel.studio.handlers.common import DEMO, tokenizer_for, user_errors
from kestrel.studio.models import ModelPool, stream_rows


def _adapter_dir(job: jobs.Job) -> Path | None:
    path = Path(job.output_dir) / "adapter"
    return path if (path / "adapter_config.json").is_file() else None


def _model_dir(job: jobs.Job) -> Path | None:
    path = Path(job.output_dir) / "model"
    return path if (path / "config.json").is_file() else None


def finished_runs() -> list[jobs.Job]:
    """Completed jobs that left an adapter or a full model behind, newest first."""
    return [j for j in jobs.list_jobs(status="completed") if _adapter_dir(j) or _model_dir(j)]


def target_choices() -> list[tuple[str, str]]:
    runs = finished_runs()
    bases = list(dict.fromkeys([DEMO] + [str(j.config.get("model", DEMO)) for j in runs]))
    out = [(S.CH_RUN_CHOICE.format(job=j.id, name=j.name or ""), f"run:{j.id}") for j in runs]
    return out + [(S.CH_BASE_CHOICE.format(model=m), f"base:{m}") for m in bases]


def resolve_target(target: str) -> tuple[str, str | None, str, str]:
    """(base model, adapter folder or None, label, base of the run) for a target string."""
    kind, _, value = (target or f"base:{DEMO}").partition(":")
    if kind == "base":
        return value, None, S.CH_BASE_CHOICE.format(model=value), value
    job = jobs.get_job(int(value))
    base = str(job.config.get("model", DEMO))
    label = S.CH_RUN_CHOICE.format(job=job.id, name=job.name or "")
    if (adapter := _adapter_dir(job)) is not None:
        return base, str(adapter), label, base
    if (model := _model_dir(job)) is not None:
        return str(model), None, label, base
    raise KestrelError(S.ERR_RUN_NO_WEIGHTS.format(job=job.id, status=job.status))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content or "")


def _messages(history: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": _text(m.get("content"))} for m in history or []
            if m.get("role") in ("user", "assistant")]


def _prompt_ids(tokenizer: Any, system: str, history: list[dict[str, str]], max_len: int, max_new: int) -> list[int]:
    """Token ids of the conversation, forgetting the oldest exchanges until the answer fits."""
    from kestrel.decode import encode_chat

    head = [{"role": "system", "content": system}] if system.strip() else []
    while True:
        ids = encode_chat(tokenizer, head + history)
        if len(ids) + max_new <= max_len or len(history) <= 1:
            return ids[-max(1, max_len - max_new):]
        history = history[2:]


def _sampling(temperature: float, top_p: float, top_k: float, repetition_penalty: float, seed: Any) -> Any:
    from kestrel.decode import SamplingParams

    text = str(seed if seed is not None else "").strip()
    if text and not text.lstrip("-").isdigit():
        raise KestrelError(S.ERR_SEED.format(value=text))
    seed_value = int(text) if text else None
    return SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k or 0),
                          repetition_penalty=float(repetition_penalty), seed=seed_value)


@user_errors
def respond(pool: ModelPool, message: str, left: list | None, right: list | None, target: str,
            side_by_side: bool, system: str, temperature: float, top_p: float, top_k: float,
            max_new_tokens: float, repetition_penalty: float, seed: Any) -> Iterator[dict[str, Any]]:
    """Stream the answer(s) to `message`. Outputs: left, right (histories), message (cleared).

    Alone, the left panel talks to `target`. Side by side, the left panel is the run's base
    model and the right panel the run, decoded as one batch of two rows.
    """
    if not (message or "").strip():
        raise KestrelError(S.CH_EMPTY)
    base, adapter, _, run_base = resolve_target(target)
    if side_by_side and not target.startswith("run:"):
        raise KestrelError(S.CH_NEED_RUN)
    sampling = _sampling(temperature, top_p, top_k, repetition_penalty, seed)
    panels = [_messages(left)] + ([_messages(right)] if side_by_side else [])
    for p in panels:
        p.append({"role": "user", "content": message})
        p.append({"role": "assistant", "content": S.CH_LOADING.format(model=base)})
    yield _out(panels, side_by_side, clear=True)
    if side_by_side and adapter is None:  # a full fine-tune: two models, one after the other
        yield from _answer_one(pool, run_base, None, panels, 0, system, sampling, max_new_tokens, side_by_side)
        yield from _answer_one(pool, base, None, panels, 1, system, sampling, max_new_tokens, side_by_side)
        return
    loaded = pool.get(base)
    name = pool.adapter(loaded, adapter, f"run-{Path(adapter).parent.name}") if adapter else None
    adapters = [None, name] if side_by_side else [name]
    prompts = [_prompt_ids(loaded.tokenizer, system or "", p[:-1], loaded.max_seq_len, int(max_new_tokens))
               for p in panels]
    yield from _stream(loaded, prompts, adapters, panels, list(range(len(panels))), sampling, max_new_tokens,
                       side_by_side)


def _answer_one(pool: ModelPool, model: str, adapter: str | None, panels: list, index: int, system: str,
                sampling: Any, max_new: float, side_by_side: bool) -> Iterator[dict[str, Any]]:
    loaded = pool.get(model)
    prompt = _prompt_ids(loaded.tokenizer, system or "", panels[index][:-1], loaded.max_seq_len, int(max_new))
    yield from _stream(loaded, [prompt], [adapter], panels, [index], sampling, max_new, side_by_side)


def _stream(loaded: Any, prompts: list, adapters: list, panels: list, indexes: list[int], sampling: Any,
            max_new: float, side_by_side: bool) -> Iterator[dict[str, Any]]:
    texts = [""] * len(prompts)
    stop = threading.Event()
    for pieces in stream_rows(loaded, prompts, adapters, int(max_new), sampling, stop):
        for row, piece in enumerate(pieces):
            texts[row] += piece
            panels[indexes[row]][-1]["content"] = texts[row]
        yield _out(panels, side_by_side)
    for row, text in enumerate(texts):
        if not text:
            panels[indexes[row]][-1]["content"] = "…"  # the model ended its turn at once
    yield _out(panels, side_by_side)


def _out(panels: list, side_by_side: bool, clear: bool = False) -> dict[str, Any]:
    return {"left": [dict(m) for m in panels[0]], "right": [dict(m) for m in panels[1]] if side_by_side else gr.skip(),
            "message": "" if clear else gr.skip()}


@user_errors
def describe_target(target: str, side_by_side: bool) -> dict[str, Any]:
    """Outputs: template (the chat template text), left / right (panel labels and visibility)."""
    base, _, label, run_base = resolve_target(target)
    tokenizer = tokenizer_for(base)
    template = getattr(tokenizer, "chat_template", "") or ""
    if side_by_side and target.startswith("run:"):
        left = gr.update(label=S.CH_BASE_CHOICE.format(model=run_base), value=[])
        right = gr.update(label=label, visible=True, value=[])
    else:
        left = gr.update(label=label, value=[])
        right = gr.update(visible=False, value=[])
    return {"template": template if isinstance(template, str) else str(template), "left": left, "right": right}


def refresh_targets(current: str | None) -> dict[str, Any]:
    choices = target_choices()
    values = [v for _, v in choices]
    return {"target": gr.update(choices=choices, value=current if current in values else values[0])}
