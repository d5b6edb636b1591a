"""Chat tab handlers: pick a run (the newest by default, its final weights or a checkpoint) or a
base model, stream answers through the engine's decode path, optionally base and fine-tuned side
by side on the same prompt, decoded as one batch.

Targets are strings: `base:<model>` or `run:<job id>`; a run's weights are `final` or a
checkpoint's step (see `weights.py`). Histories are Gradio's message dicts (`{"role",
"content"}`), one per chat panel, owned by the browser.

    for out in respond(pool, "What is 2 + 3?", [], [], "run:3", "final", True, "", 0.0, 1.0, 0, 64, 1.0, None):
        out["left"], out["right"]    # base and fine-tuned conversations so far
        out["stats"]                 # tokens and tokens/s of each answer
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from kestrel import jobs
from kestrel.errors import KestrelError
from kestrel.studio import strings as S
from kestrel.studio.handlers.common import DEMO, tokenizer_for, user_errors
from kestrel.studio.handlers.weights import follow_newest, run_of, usable_runs, weights_choice, weights_of
from kestrel.studio.models import LoadedModel, ModelPool, RowSpeed, stream_rows


def target_choices(runs: list[jobs.Job] | None = None) -> list[tuple[str, str]]:
    """Runs with weights (newest first), then the base models: the demo and those runs' bases."""
    runs = usable_runs() if runs is None else runs
    bases = list(dict.fromkeys([DEMO] + [str(j.config.get("model", DEMO)) for j in runs]))
    out = [(S.CH_RUN_CHOICE.format(job=j.id, name=j.name or ""), f"run:{j.id}") for j in runs]
    return out + [(S.CH_BASE_CHOICE.format(model=m), f"base:{m}") for m in bases]


@dataclass(frozen=True)
class Target:
    """What a target and weights choice load: `model` (+ `adapter`) answers; `run_base` is the
    base model beside it in the side-by-side view (the model itself for a base target)."""

    model: str
    adapter: str | None
    label: str
    run_base: str
    is_run: bool


def resolve_target(target: str, checkpoint: str | None = None) -> Target:
    kind, _, value = (target or f"base:{DEMO}").partition(":")
    if kind == "base":
        return Target(value, None, S.CH_BASE_CHOICE.format(model=value), value, False)
    if not value.isdigit():
        raise KestrelError(S.CH_BAD_TARGET.format(target=target))
    job = jobs.get_job(int(value))
    base = str(job.config.get("model", DEMO))
    found = weights_of(job, checkpoint)
    label = S.CH_RUN_CHOICE.format(job=job.id, name=job.name or "")
    if found.step is not None:
        label += S.CH_AT_STEP.format(step=found.step)
    elif found.best:
        label += S.CH_BEST
    if found.adapter is not None:
        return Target(base, str(found.adapter), label, base, True)
    return Target(str(found.model), None, label, base, True)


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
def respond(pool: ModelPool, message: str, left: list | None, right: list | None, target: str, checkpoint: str | None,
            side_by_side: bool, system: str, temperature: float, top_p: float, top_k: float,
            max_new_tokens: float, repetition_penalty: float, seed: Any) -> Iterator[dict[str, Any]]:
    """Stream the answer(s) to `message`. Outputs: left, right (histories), message (cleared),
    stats (tokens and tokens/s of each answer).

    Alone, the left panel talks to `target`. Side by side, the left panel is the run's base
    model and the right panel the run, decoded as one batch of two rows: a LoRA run on its base
    model with the adapter masked off for row 0; a full fine-tune and its base as two models
    behind one decode loop (`ModelPool.pair`).
    """
    if not (message or "").strip():
        raise KestrelError(S.CH_EMPTY)
    tgt = resolve_target(target, checkpoint)
    if side_by_side and not tgt.is_run:
        raise KestrelError(S.CH_NEED_RUN)
    sampling = _sampling(temperature, top_p, top_k, repetition_penalty, seed)
    panels = [_messages(left)] + ([_messages(right)] if side_by_side else [])
    names = [S.CH_BASE_CHOICE.format(model=tgt.run_base), tgt.label] if side_by_side else [tgt.label]
    for p, model in zip(panels, [tgt.run_base, tgt.model] if side_by_side else [tgt.model]):
        p.append({"role": "user", "content": message})
        p.append({"role": "assistant", "content": S.CH_LOADING.format(model=model)})
    yield {**_out(panels, side_by_side), "message": "", "stats": ""}
    max_new = int(max_new_tokens)
    if side_by_side and tgt.adapter is None:  # a full fine-tune: its base is another model
        models = [pool.get(tgt.run_base), pool.get(tgt.model)]
        loaded = pool.pair(models)
        if loaded is None:  # tokenizers differ: no shared sampler or stop list, one after the other
            done = ""  # the first answer's stats line, kept while the second streams
            for i, m in enumerate(models):
                for out in _stream(m, [_prompt(m, system, panels[i], max_new)], [None], panels, [i], sampling,
                                   max_new, [names[i]], side_by_side):
                    out["stats"] = done + out["stats"]
                    yield out
                done = out["stats"] + "  \n"
            return
        prompts = [_prompt(m, system, p, max_new) for m, p in zip(models, panels)]
        yield from _stream(loaded, prompts, [None, None], panels, [0, 1], sampling, max_new, names, side_by_side)
        return
    loaded = pool.get(tgt.model)
    name = pool.adapter(loaded, tgt.adapter) if tgt.adapter else None
    adapters = [None, name] if side_by_side else [name]
    prompts = [_prompt(loaded, system, p, max_new) for p in panels]
    yield from _stream(loaded, prompts, adapters, panels, list(range(len(panels))), sampling, max_new, names,
                       side_by_side)


def _prompt(loaded: LoadedModel, system: str, panel: list[dict[str, str]], max_new: int) -> list[int]:
    """The panel's conversation (its answer placeholder left out) as the model's prompt ids."""
    return _prompt_ids(loaded.tokenizer, system or "", panel[:-1], loaded.max_seq_len, max_new)


def _stream(loaded: LoadedModel, prompts: list, adapters: list, panels: list, indexes: list[int], sampling: Any,
            max_new: int, names: list[str], side_by_side: bool) -> Iterator[dict[str, Any]]:
    texts = [""] * len(prompts)
    stop = threading.Event()
    speed = RowSpeed(len(prompts), loaded.generator.stop_ids)
    for pieces in stream_rows(loaded, prompts, adapters, max_new, sampling, stop, speed):
        for row, piece in enumerate(pieces):
            texts[row] += piece
            panels[indexes[row]][-1]["content"] = texts[row]
        yield {**_out(panels, side_by_side), "stats": _stats(speed, names)}
    for row, text in enumerate(texts):
        if not text:
            panels[indexes[row]][-1]["content"] = "…"  # the model ended its turn at once
    yield {**_out(panels, side_by_side), "stats": _stats(speed, names)}


def _stats(speed: RowSpeed, names: list[str]) -> str:
    """One line per answer: its tokens, seconds (prompt included) and tokens per second."""
    return "  \n".join(S.CH_SPEED.format(name=name, tokens=speed.tokens[row], seconds=speed.seconds(row),
                                          rate=speed.rate(row)) for row, name in enumerate(names))


def _out(panels: list, side_by_side: bool) -> dict[str, Any]:
    return {"left": [dict(m) for m in panels[0]], "right": [dict(m) for m in panels[1]] if side_by_side else gr.skip()}


_PLACEHOLDER = re.compile(re.escape(S.CH_LOADING).replace(re.escape("{model}"), ".*"), re.DOTALL)


def stopped(left: list | None, right: list | None) -> dict[str, Any]:
    """After Stop: an answer that had not started (still the loading placeholder, or empty) says
    it was stopped. Outputs: left, right."""
    def settle(history: list | None) -> Any:
        if not history or history[-1].get("role") != "assistant":
            return gr.skip()
        content = _text(history[-1].get("content"))
        if content.strip() and not _PLACEHOLDER.fullmatch(content):
            return gr.skip()
        return [*history[:-1], {"role": "assistant", "content": S.CH_STOPPED}]
    return {"left": settle(left), "right": settle(right)}


@user_errors
def describe_target(target: str, checkpoint: str | None, side_by_side: bool) -> dict[str, Any]:
    """Outputs: checkpoint (the run's weights to choose from), template (the chat template text),
    left / right (panel labels and visibility, emptied), note (the demo model's warning)."""
    ckpt, checkpoint = weights_choice(run_of(target), checkpoint)
    tgt = resolve_target(target, checkpoint)
    tokenizer = tokenizer_for(tgt.model)
    template = getattr(tokenizer, "chat_template", "") or ""
    if side_by_side and tgt.is_run:
        left = gr.update(label=S.CH_BASE_CHOICE.format(model=tgt.run_base), value=[])
        right = gr.update(label=tgt.label, visible=True, value=[])
    else:
        left = gr.update(label=tgt.label, value=[])
        right = gr.update(visible=False, value=[])
    demo = tgt.run_base == DEMO
    note = gr.update(visible=demo, value=(S.CH_DEMO_RUN_NOTE if tgt.is_run else S.CH_DEMO_NOTE) if demo else "")
    return {"checkpoint": ckpt, "template": template if isinstance(template, str) else str(template), "left": left,
            "right": right, "note": note, "stats": ""}


def refresh_targets(current: str | None, seen: int | None) -> dict[str, Any]:
    """Outputs: target (the list; the newest run when one appeared since `seen`), seen (the newest
    run's id now)."""
    runs = usable_runs()
    choices = target_choices(runs)
    value = follow_newest([v for _, v in choices], current, seen, runs)
    return {"target": gr.update(choices=choices, value=value), "seen": runs[0].id if runs else seen}


def show_targets(current: str | None, seen: int | None, checkpoint: str | None, side_by_side: bool) -> dict[str, Any]:
    """`refresh_targets`, with `describe_target`'s outputs when the choice changed (else the
    weights' list, which gains checkpoints saved since). Whatever sets the list describes its
    choice in the same answer: a describe chained on the list's change event is one more round trip
    that other events of the page can overtake, and under load a stale answer stayed (the browser
    test saw Export's weights list never appear, and Chat's right panel hidden)."""
    out = refresh_targets(current, seen)
    value = out["target"]["value"]
    if value != current:
        return {**out, **describe_target(value, checkpoint, side_by_side)}
    return {**out, "checkpoint": weights_choice(run_of(value), checkpoint)[0]}  # checkpoints saved since
