"""Binding widgets to handlers: the only place that knows both.

Handlers return dicts of named outputs; `Outputs` turns such a dict into the tuple Gradio wants
for a list of (name, component) pairs (a name may feed several components, a missing name
leaves its component untouched). Event chains that touch two tabs (a dataset opened on the
Datasets tab fills the Train form; Start switches to the Runs tab) are spelled out here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import gradio as gr

from kestrel.studio.components.runs import FOLLOW_LOG_JS
from kestrel.studio.form import FORM_KEYS
from kestrel.studio.handlers import chat as chat_h
from kestrel.studio.handlers import datasets as ds_h
from kestrel.studio.handlers import export as ex_h
from kestrel.studio.handlers import generation as gen_h
from kestrel.studio.handlers import runs as runs_h
from kestrel.studio.handlers import train as train_h
from kestrel.studio.handlers import weights as weights_h
from kestrel.studio.handlers.datasets import roles
from kestrel.studio.handlers.train import form_to_config
from kestrel.studio.models import ModelPool
from kestrel.studio.settings import StudioSettings

C = dict[str, gr.Component]


def hidden(anchor: gr.Component) -> dict[str, Any]:
    """Keyword arguments of an event that shows no progress: its loading state is kept on
    `anchor` (the page's header), never on its outputs. Gradio's page keeps the loading state of
    every component any event has named as a progress target (by default, its outputs; once an
    event completes, its inputs too), and on each status message of every event it re-applies all
    of them, each after a walk of the whole layout and a deep copy of the component's value: with
    the studio's 125 outputs that was most of an edit's time. Every event of the studio therefore
    names its progress targets: this anchor, or one status line per tab where progress shows."""
    return {"show_progress": "hidden", "show_progress_on": [anchor]}


def light(anchor: gr.Component) -> dict[str, Any]:
    """`hidden`, off Gradio's queue: for cheap handlers (milliseconds of work). A queued event pays
    a join request and a server-sent-events round trip, which doubled the answer time of a click
    while a job trained on the same CPU. Heavy or streaming handlers (dataset reading, Start, chat,
    export) stay queued, where concurrency limits apply."""
    return {"queue": False, **hidden(anchor)}


class Outputs:
    """(name, component) pairs; `wrap(fn)` adapts a dict-returning handler to them."""

    def __init__(self, pairs: list[tuple[str, gr.Component]]) -> None:
        self.pairs = pairs

    @classmethod
    def of(cls, c: C, *names: str) -> Outputs:
        return cls([(n, c[n]) for n in names])

    def __add__(self, other: Outputs) -> Outputs:
        return Outputs(self.pairs + other.pairs)

    @property
    def components(self) -> list[gr.Component]:
        return [comp for _, comp in self.pairs]

    def _tuple(self, result: dict[str, Any]) -> Any:
        values = tuple(result.get(name, gr.skip()) for name, _ in self.pairs)
        return values[0] if len(values) == 1 else values

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isgeneratorfunction(fn) or inspect.isgeneratorfunction(getattr(fn, "func", None)):
            def gen(*args: Any) -> Iterator[Any]:
                for result in fn(*args):
                    yield self._tuple(result)
            return gen
        return lambda *args: self._tuple(fn(*args))


def _on(trigger: Any, fn: Callable[..., Any], inputs: list[gr.Component], outputs: Outputs, **kw: Any) -> Any:
    """`trigger(fn)` on dict-returning `fn`; `kw` must name the progress targets (see `hidden`)."""
    if "show_progress_on" not in kw:
        raise TypeError("every studio event names its progress targets (show_progress_on): see events.hidden")
    kw.setdefault("show_progress", "minimal")
    return trigger(outputs.wrap(fn), inputs=inputs, outputs=outputs.components, **kw)


def _on_latest(triggers: list[Any], fn: Callable[..., Any], inputs: list[gr.Component], outputs: Outputs,
               **kw: Any) -> Any:
    """One event for several fields' triggers, run one at a time with the latest trigger last. As
    separate events (each reading its inputs when sent) they could finish out of order, and the
    stale answer stayed: a describe of the Chat target, sent before "side by side" was ticked,
    finished after the one that showed the right panel and hid it (under load in the browser test)."""
    return _on(partial(gr.on, triggers), fn, inputs, outputs, trigger_mode="always_last", **kw)


# What a Chat choice (model or run, weights, side by side) and an Export choice (source, weights,
# format) describe. The events that set a choice's list describe it in the same answer, and the
# events that describe on their own follow the user's input only, never a change made by an answer
# (see kestrel.studio.handlers.chat.show_targets).
DESCRIBED = ("checkpoint", "template", "left", "right", "note", "stats")
PICKED = ("checkpoint", "quant")


def show_targets_inputs(ch: C) -> list[gr.Component]:
    return [ch["target"], ch["seen"], ch["checkpoint"], ch["side"]]


def show_sources_inputs(ex: C) -> list[gr.Component]:
    return [ex["source"], ex["seen"], ex["checkpoint"], ex["format"], ex["quant"]]


def model_name(source: str, text: str) -> str:
    return form_to_config({"model_source": source, "model": text})["model"]


# ---------------------------------------------------------------------------------------------
# Datasets tab (+ the Train form it feeds)


def wire_datasets(d: C, t: C, tab: gr.Tab, settings: StudioSettings, anchor: gr.Component) -> None:
    """The Datasets tab (`tab`) and the Train form fields it fills; `anchor`: see `hidden`."""
    lt = light(anchor)
    model_in = [t["model_source"], t["model"]]
    tokens = Outputs.of(d, "tokens", "token_summary", "truncation")
    shown = Outputs.of(d, "state", "status", "summary", "format", "preview", "report", "histogram", "row",
                       *[f"col_{r}" for r in roles()]) + Outputs([("datasets", d["datasets"]),
                                                                  ("datasets", t["dataset"])]) + tokens
    token_in = [d["state"], d["row"], *model_in, t["max_seq_length"], t["train_on_responses_only"]]
    to_form = Outputs([("dataset", t["dataset"]), ("dataset_format", t["dataset_format"]), ("extra", t["extra"])])

    def preview_tokens(state: Any, row: Any, src: str, text: str, max_len: Any, responses: bool) -> dict[str, Any]:
        if not state or not state.get("usable", True):
            return {}  # no format found: open_dataset cleared the preview
        return ds_h.token_preview(state, row, model_name(src, text), max_len, responses)

    def after_open(event: Any) -> None:
        event.success(tokens.wrap(preview_tokens), token_in, tokens.components, **hidden(anchor)) \
             .then(to_form.wrap(train_h.use_dataset), [d["state"], t["extra"]], to_form.components, **lt) \
             .then(*_preview_args(t, settings), **lt)

    reading = {"show_progress_on": [d["status"]]}  # reading a large file takes seconds: progress shows there
    # The upload box empties once the file is stored (it is listed under the datasets), ready for the next one.
    after_open(_on(d["upload"].upload,
                   lambda f, src, text: {**ds_h.upload_dataset(f, settings.max_upload_mb, model_name(src, text)),
                                         "upload": None},
                   [d["upload"], *model_in], shown + Outputs([("upload", d["upload"])]), **reading))
    after_open(_on(d["use_sample"].click, lambda p, src, text: ds_h.open_dataset(p, "auto", None, model_name(src, text)),
                   [d["sample"], *model_in], shown, **reading))
    after_open(_on(d["open"].click, lambda p, src, text: ds_h.open_dataset(p, "auto", None, model_name(src, text)),
                   [d["datasets"], *model_in], shown, **reading))
    after_open(_on(d["apply_mapping"].click,
                   lambda state, fmt, src, text, *cols: ds_h.apply_mapping(state, fmt, model_name(src, text), *cols),
                   [d["state"], d["format"], *model_in, *[d[f"col_{r}"] for r in roles()]], shown, **reading))
    _on(d["row"].input, preview_tokens, token_in, tokens, trigger_mode="always_last", **lt)
    # The token view and the truncation warning follow the Train form's model, length and masking
    # when the tab is opened, not on every edit of the Train form: a hidden view is not redrawn,
    # and an edit there pays one round trip (its own preview), not two.
    _on(tab.select, preview_tokens, token_in, tokens, **lt)
    _on(d["format"].input, ds_h.show_roles, [d["format"]], Outputs.of(d, *[f"col_{r}" for r in roles()]), **lt)
    picked = Outputs([("dataset_format", t["dataset_format"]), ("extra", t["extra"])])
    _on(t["dataset"].input, train_h.pick_dataset, [t["dataset"], d["state"], t["extra"]], picked, **lt) \
        .then(*_preview_args(t, settings), **lt)


# ---------------------------------------------------------------------------------------------
# Train tab


def _form(t: C) -> list[gr.Component]:
    return [t[k] for k in FORM_KEYS]


def _filled(t: C) -> Outputs:
    return Outputs.of(t, *FORM_KEYS, "extra", "yaml", "download", "vram", "status")


def _preview_args(t: C, settings: StudioSettings, keep_status: bool = False) -> tuple[Any, ...]:
    """The live preview's (fn, inputs, outputs). `keep_status`: after a fill (preset, YAML) the
    status says what the fill did, and the preview that follows must not wipe it."""
    out = Outputs.of(t, "yaml", "download", "vram", *(() if keep_status else ("status",)))

    def preview(extra: Any, gpu: str | None, *values: Any) -> dict[str, Any]:
        return train_h.preview(extra, *values, gpu=gpu, allow_custom=settings.allow_custom_rewards)

    return out.wrap(preview), [t["extra"], t["gpu"], *_form(t)], out.components


def wire_train(t: C, r: C, tabs: gr.Tabs, settings: StudioSettings, anchor: gr.Component) -> None:
    """The Train tab; `settings.allow_custom_rewards` (the launch flag) reaches every handler that builds a config."""
    lt = light(anchor)
    allow = {"allow_custom": settings.allow_custom_rewards}
    t["model_source"].change(weights_h.model_box, t["model_source"], t["model"], **lt)
    fn, inputs, outputs = _preview_args(t, settings)
    gr.on([t[k].input for k in (*FORM_KEYS, "gpu")], fn, inputs, outputs, trigger_mode="always_last", **lt)
    filled = _filled(t)
    # then the preview again: its memory estimate is for the GPU picked on a machine without one
    after_fill = _preview_args(t, settings, keep_status=True)
    _on(t["apply_preset"].click, partial(train_h.apply_preset, **allow), [t["preset"], t["extra"], *_form(t)], filled,
        **lt).then(*after_fill, **lt)
    _on(t["apply_yaml"].click, partial(train_h.apply_yaml, **allow), [t["yaml"]], filled, **lt) \
        .then(*after_fill, **lt)
    _on(t["load_yaml"].upload, partial(train_h.load_yaml_file, **allow), [t["load_yaml"]], filled, **lt) \
        .then(*after_fill, **lt)
    started = Outputs([("status", t["status"]), ("job", r["started"])])
    runs_out = _runs_outputs(r)
    _on(t["start"].click, partial(train_h.start_training, **allow), [t["extra"], *_form(t)], started,
        concurrency_limit=1, show_progress_on=[t["status"]]) \
        .success(lambda: (gr.Tabs(selected="runs"), gr.Timer(active=True)), None, [tabs, r["timer"]], **lt) \
        .then(runs_out.wrap(runs_h.select_job), _runs_inputs(r, "started"), runs_out.components, **lt)


# ---------------------------------------------------------------------------------------------
# Runs tab


def _runs_inputs(r: C, picked: str = "select") -> list[gr.Component]:
    """select_job's inputs: the run in `r[picked]`, what this browser drew, the notice's record."""
    return [r[picked], r["seen"], r["noticed"]]


def _runs_outputs(r: C) -> Outputs:
    charts = [k for k in r if k.startswith("chart_")]
    return Outputs.of(r, "table", "select", "progress", *charts, "grpo", *gen_h.OUTPUTS, *runs_h.ACTIONS, "notice",
                      "log", "seen", "noticed")


def wire_runs(r: C, anchor: gr.Component) -> None:
    lt = light(anchor)
    out = _runs_outputs(r)
    state_in = _runs_inputs(r)
    _on(r["timer"].tick, runs_h.refresh, state_in, out, trigger_mode="always_last", **lt)
    _on(r["refresh"].click, runs_h.select_job, state_in, out, **lt)
    _on(r["select"].input, runs_h.select_job, state_in, out, **lt)
    r["table"].select(runs_h.select_row, r["table"], r["select"], **lt) \
        .then(out.wrap(runs_h.select_job), state_in, out.components, **lt)
    notice = Outputs.of(r, "notice", "noticed")
    for action in runs_h.ACTIONS:
        _on(r[action].click, partial(runs_h.act_and_note, action), [r["select"], r["remove_files"]], notice,
            **lt) \
            .then(out.wrap(runs_h.select_job), state_in, out.components, **lt)
    r["log"].change(None, None, None, js=FOLLOW_LOG_JS, **lt)
    compare = Outputs.of(r, "compare_loss", "compare_diff")
    _on(r["compare"].click, runs_h.compare, [r["compare_select"]], compare, **lt)
    # Queued (a check loads a model and decodes for seconds); one at a time per studio.
    r["check_generations"].click(lambda: gr.Accordion(open=True), None, r["generation_panel"], **lt)
    _on(r["check_generations"].click, gen_h.check_generations, [r["select"]], Outputs.of(r, *gen_h.OUTPUTS),
        concurrency_limit=1, **hidden(anchor))


# ---------------------------------------------------------------------------------------------
# Chat and Export tabs


def wire_chat(ch: C, pool: ModelPool, anchor: gr.Component) -> None:
    lt = light(anchor)
    described = Outputs.of(ch, *DESCRIBED)
    pick = [ch["target"], ch["checkpoint"], ch["side"]]
    _on_latest([ch["target"].input, ch["side"].input, ch["checkpoint"].input], chat_h.describe_target, pick,
               described, **lt)
    _on(ch["refresh"].click, chat_h.show_targets, show_targets_inputs(ch), Outputs.of(ch, "target", "seen") + described,
        **lt)
    answer = Outputs.of(ch, "left", "right", "message", "stats")
    inputs = [ch[k] for k in ("message", "left", "right", "target", "checkpoint", "side", "system", "temperature",
                              "top_p", "top_k", "max_new_tokens", "repetition_penalty", "seed")]
    respond = partial(chat_h.respond, pool)
    # trigger_mode "multiple": with Gradio's default ("once") the page drops a trigger while it
    # counts the event as pending, and a Stop that cancels an answer mid-start can leave it counted
    # so for good: Send then did nothing until a reload. Answers still run one at a time (the queue).
    events = [_on(trigger, respond, inputs, answer, trigger_mode="multiple", **hidden(anchor))
              for trigger in (ch["send"].click, ch["message"].submit)]
    panels = Outputs.of(ch, "left", "right")
    # Stop cancels the answer, then replaces an answer that had not begun (its loading note).
    ch["stop"].click(None, None, None, cancels=events) \
        .then(panels.wrap(chat_h.stopped), [ch["left"], ch["right"]], panels.components, **lt)
    ch["clear"].click(lambda: ([], [], ""), None, [ch["left"], ch["right"], ch["stats"]], cancels=events, **lt)


def wire_export(ex: C, anchor: gr.Component) -> None:
    lt = light(anchor)
    _on(ex["refresh"].click, ex_h.show_sources, show_sources_inputs(ex), Outputs.of(ex, "source", "seen", *PICKED),
        **lt)
    pick_in = [ex["source"], ex["checkpoint"], ex["format"], ex["quant"]]
    _on_latest([ex["source"].input, ex["format"].input, ex["checkpoint"].input], ex_h.pick_source, pick_in,
               Outputs.of(ex, *PICKED), **lt)
    _on(ex["start"].click, ex_h.run_export, [ex["source"], ex["checkpoint"], ex["format"], ex["quant"]],
        Outputs.of(ex, "status", "file", "modelfile"), concurrency_limit=1, show_progress_on=[ex["status"]])


# ---------------------------------------------------------------------------------------------
# Page load: fill the Datasets, Train and Runs tabs from the store (a reload shows running jobs live
# again); Chat and Export fill their lists when opened


def wire_load(app: gr.Blocks, d: C, t: C, r: C, settings: StudioSettings, anchor: gr.Component) -> None:
    runs_out = _runs_outputs(r)
    outputs = (Outputs([("samples", d["sample"]), ("datasets", d["datasets"])])
               + _filled(t) + Outputs.of(t, "gpu") + runs_out)

    def load(seen: Any) -> dict[str, Any]:
        samples = ds_h.sample_choices()
        result: dict[str, Any] = {"samples": gr.update(choices=samples, value=samples[0][1] if samples else None)}
        result.update(ds_h.refresh_choices())
        result.update(train_h.apply_preset("demo", {}, *[None] * len(FORM_KEYS),
                                           allow_custom=settings.allow_custom_rewards))
        result["status"] = ""
        result.update(train_h.gpu_picker())
        result["dataset"] = gr.update(choices=ds_h.dataset_choices(), value=result["dataset"])
        result.update(runs_h.refresh(None, {}, force=True))
        # Chat's and Export's lists are filled by their tab's select alone: an answer of this slow
        # event that arrived after a tab was opened put back the list it had read before a run
        # finished (CI: Export showed the demo model again, with no weights list).
        return result

    app.load(outputs.wrap(load), [r["seen"]], outputs.components, **hidden(anchor))


def _timers_for(tab: str) -> tuple[gr.Timer, gr.Timer]:
    """(Runs polling, Export's recent list) switched on only on their own tab."""
    return gr.Timer(active=tab == "runs"), gr.Timer(active=tab == "export")


# The tab the page shows when a tab's select is sent (its `gr.Tab` id). Gradio also sends the first
# tab's select as the page mounts, which can come after a click on another tab (a reload, then a
# quick click): a handler that trusted its own tab switched the polling off under the Runs tab.
SHOWN_TAB_JS = "() => document.querySelector('button[role=tab][aria-selected=true]')?.dataset.tabId ?? ''"


def wire_tab_switches(tabs: dict[str, gr.Tab], shown: gr.Component, t: C, r: C, ch: C, ex: C,
                      anchor: gr.Component) -> None:
    """Opening a tab refreshes the lists that other tabs (or the command line) may have changed.
    The Runs tab and Export's list of recent exports poll only while their tab is shown (`shown`,
    a hidden box, carries its id from the page): a browser on another tab costs the server nothing."""
    lt = light(anchor)
    runs_out = _runs_outputs(r)
    gr.on([tab.select for tab in tabs.values()], _timers_for, [shown], [r["timer"], ex["recent_timer"]],
          js=SHOWN_TAB_JS, trigger_mode="always_last", **lt)
    _on(tabs["runs"].select, runs_h.select_job, _runs_inputs(r), runs_out, **lt)
    _on(tabs["runs"].select, lambda: runs_h.compare_choices(), [], Outputs.of(r, "compare_select"), **lt)
    _on(tabs["chat"].select, chat_h.show_targets, show_targets_inputs(ch), Outputs.of(ch, "target", "seen", *DESCRIBED),
        **lt)
    tabs["train"].select(weights_h.model_box, t["model_source"], t["model"], **lt)  # runs finished since
    _on(tabs["export"].select, ex_h.show_sources, show_sources_inputs(ex), Outputs.of(ex, "source", "seen", *PICKED),
        **lt)
    # The list of recent exports is re-read from the store (a restarted studio loses nothing).
    gr.on([tabs["export"].select, ex["recent_timer"].tick], ex_h.recent_exports, None, ex["recent"], **lt)
