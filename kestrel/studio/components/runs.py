"""Runs tab layout: job table, the selected run's progress, actions, live charts, log tail, and
the comparison of several runs. A gr.Timer drives the polling."""

from __future__ import annotations

import gradio as gr

from kestrel.studio import strings as S

POLL_S = 1.0  # with the worker's 1 s metric flush, charts stay under 2 s behind
# The log box follows its end unless the user has scrolled up to read (Gradio's own autoscroll
# reacts only to its first update). Run in the page after each new value of the log.
FOLLOW_LOG_JS = """() => requestAnimationFrame(() => {
  const t = document.querySelector('#ru-log textarea');
  if (!t) return;
  if (!t.dataset.follow) {
    t.dataset.follow = 'yes';
    t.addEventListener('scroll', () => {
      t.dataset.follow = t.scrollTop + t.clientHeight >= t.scrollHeight - 8 ? 'yes' : 'no';
    });
  }
  if (t.dataset.follow === 'yes') t.scrollTop = t.scrollHeight;
})"""


def _chart(key: str) -> gr.LinePlot:
    return gr.LinePlot(x="step", y="value", color="name", title=S.CHARTS[key], height=220, min_width=300,
                       elem_id=f"chart-{key.replace('_', '-')}")


def _generation_panel(c: dict[str, gr.Component]) -> None:
    """The generation check: a summary line and prompt / reference / answer rows, and the button
    that runs it again on demand (enabled by the Runs handlers for a finished run that can)."""
    with gr.Accordion(S.RU_GENERATION, open=False, elem_id="ru-generation") as panel:
        with gr.Row():
            c["generation_summary"] = gr.Markdown(S.RU_GEN_NONE, elem_id="ru-generation-summary")
            c["check_generations"] = gr.Button(S.RU_GEN_CHECK, size="sm", interactive=False, scale=0,
                                               min_width=160, elem_id="ru-check-generations")
        c["generation_table"] = gr.Dataframe(headers=S.RU_GEN_COLUMNS, interactive=False, wrap=True, max_height=360,
                                             elem_id="ru-generation-table")
    c["generation_panel"] = panel


def build() -> dict[str, gr.Component]:
    # The timer runs only while this tab is shown (kestrel.studio.events switches it with the tabs).
    c: dict[str, gr.Component] = {"seen": gr.State({}), "timer": gr.Timer(POLL_S, active=False),
                                  "started": gr.State(None), "noticed": gr.State(None)}
    c["table"] = gr.Dataframe(label=S.RU_TABLE, headers=S.RU_COLUMNS, interactive=False, max_height=260,
                              elem_id="ru-table")
    with gr.Row():
        c["select"] = gr.Dropdown(label=S.RU_SELECT, choices=[], scale=3, elem_id="ru-select")
        c["refresh"] = gr.Button(S.RU_REFRESH, size="sm", scale=1, elem_id="ru-refresh")
    c["progress"] = gr.Markdown(elem_id="ru-progress")
    with gr.Row():
        # Enabled by the Runs handlers for the selected run's status (runs.VALID_IN).
        c["pause"] = gr.Button(S.RU_PAUSE, size="sm", interactive=False, elem_id="ru-pause")
        c["resume"] = gr.Button(S.RU_RESUME, size="sm", interactive=False, elem_id="ru-resume")
        c["cancel"] = gr.Button(S.RU_CANCEL, size="sm", variant="stop", interactive=False, elem_id="ru-cancel")
        c["delete"] = gr.Button(S.RU_DELETE, size="sm", variant="stop", interactive=False, elem_id="ru-delete")
        c["remove_files"] = gr.Checkbox(label=S.RU_DELETE_FILES, value=False)
    c["notice"] = gr.Markdown(elem_id="ru-notice")
    with gr.Row():
        for key in ("loss", "lr", "grad_norm"):
            c[f"chart_{key}"] = _chart(key)
    with gr.Row():
        for key in ("tokens_per_s", "memory"):
            c[f"chart_{key}"] = _chart(key)
    with gr.Row(visible=False) as grpo_row:
        for key in ("reward", "kl"):
            c[f"chart_{key}"] = _chart(key)
    c["grpo"] = grpo_row
    _generation_panel(c)
    c["log"] = gr.Textbox(label=S.RU_LOG, lines=12, max_lines=12, autoscroll=True, interactive=False,
                          elem_id="ru-log")
    with gr.Accordion(S.RU_COMPARE, open=False):
        with gr.Row():
            c["compare_select"] = gr.Dropdown(label=S.RU_SELECT, choices=[], multiselect=True, scale=3)
            c["compare"] = gr.Button(S.RU_COMPARE_BTN, size="sm", scale=1)
        c["compare_loss"] = gr.LinePlot(x="step", y="value", color="run", title=S.RU_COMPARE_LOSS, height=260)
        c["compare_diff"] = gr.Dataframe(label=S.RU_CONFIG_DIFF, interactive=False, wrap=True)
    return c
