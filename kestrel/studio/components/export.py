"""Export tab layout: run and its weights (final or a checkpoint), format, quantization (with
size and quality hints), Export, progress, download and Modelfile, then
the recent export jobs, re-read from the store every RECENT_EVERY_S."""

from __future__ import annotations

import gradio as gr

from kestrel.studio import strings as S

RECENT_EVERY_S = 2.0  # exports run for minutes: a list two seconds behind is live enough


def build() -> dict[str, gr.Component]:
    """The tab's components by name (`kestrel.studio.events` wires source, format, quant, start and the outputs)."""
    c: dict[str, gr.Component] = {}
    with gr.Row():
        c["source"] = gr.Dropdown(label=S.EX_RUN, choices=[], scale=3, elem_id="ex-source")
        c["checkpoint"] = gr.Dropdown(label=S.EX_CHECKPOINT, choices=[], scale=2, visible=False,
                                      elem_id="ex-checkpoint")
        c["refresh"] = gr.Button(S.CH_REFRESH, size="sm", scale=1)
    c["seen"] = gr.State(None)  # the newest run's id when the list was last filled
    with gr.Row():
        c["format"] = gr.Radio(label=S.EX_FORMAT, choices=[(v, k) for k, v in S.EX_FORMATS.items()],
                               value="gguf", elem_id="ex-format")
        c["quant"] = gr.Dropdown(label=S.EX_QUANT, choices=[], elem_id="ex-quant")
    c["start"] = gr.Button(S.EX_START, variant="primary", elem_id="ex-start")
    c["status"] = gr.Markdown(elem_id="ex-status")
    c["file"] = gr.File(label=S.EX_FILE, file_count="multiple", interactive=False, elem_id="ex-file")
    c["modelfile"] = gr.Code(label=S.EX_MODELFILE, language="dockerfile", interactive=False, elem_id="ex-modelfile")
    # Filled when the tab opens, then on each tick while it is shown (kestrel.studio.events).
    c["recent_timer"] = gr.Timer(RECENT_EVERY_S, active=False)
    c["recent"] = gr.Markdown(elem_id="ex-recent")
    return c
