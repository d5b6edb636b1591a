"""Chat tab layout: model or run and the run's weights (final or a checkpoint), side-by-side
switch, the demo model's note, one or two chat panels, each answer's tokens/s, message box with
Send / Stop, sampling controls and the model's chat template."""

from __future__ import annotations

import gradio as gr

from kestrel.studio import strings as S


def build() -> dict[str, gr.Component]:
    c: dict[str, gr.Component] = {}
    with gr.Row():
        c["target"] = gr.Dropdown(label=S.CH_MODEL, choices=[], scale=3, elem_id="ch-target")
        c["checkpoint"] = gr.Dropdown(label=S.CH_CHECKPOINT, choices=[], scale=2, visible=False,
                                      elem_id="ch-checkpoint")
        c["side"] = gr.Checkbox(label=S.CH_SIDE, value=False, scale=1, elem_id="ch-side")
        c["refresh"] = gr.Button(S.CH_REFRESH, size="sm", scale=1)
    c["seen"] = gr.State(None)  # the newest run's id when the list was last filled
    c["note"] = gr.Markdown(visible=False, elem_id="ch-note")
    with gr.Row():
        c["left"] = gr.Chatbot(label=S.CH_BASE, height=380, elem_id="ch-left")
        c["right"] = gr.Chatbot(label=S.CH_TUNED, height=380, visible=False, elem_id="ch-right")
    c["stats"] = gr.Markdown(elem_id="ch-stats")
    with gr.Row():
        c["message"] = gr.Textbox(label=S.CH_MESSAGE, lines=2, scale=4, elem_id="ch-message")
        with gr.Column(scale=1, min_width=120):
            c["send"] = gr.Button(S.CH_SEND, variant="primary", elem_id="ch-send")
            c["stop"] = gr.Button(S.CH_STOP, variant="stop", elem_id="ch-stop")
            c["clear"] = gr.Button(S.CH_CLEAR, size="sm")
    with gr.Accordion(S.CH_SAMPLING, open=False):
        c["system"] = gr.Textbox(label=S.CH_SYSTEM, lines=2)
        with gr.Row():
            c["temperature"] = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="temperature (0 = greedy)")
            c["top_p"] = gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="top-p")
            c["top_k"] = gr.Slider(0, 200, value=0, step=1, label="top-k (0 = off)")
        with gr.Row():
            c["max_new_tokens"] = gr.Slider(1, 2048, value=256, step=1, label="max new tokens",
                                            elem_id="ch-max-new")
            c["repetition_penalty"] = gr.Slider(0.8, 2.0, value=1.0, step=0.05, label="repetition penalty")
            c["seed"] = gr.Textbox(label="seed (empty = random)", value="")
    with gr.Accordion(S.CH_TEMPLATE, open=False):
        c["template"] = gr.Code(language="jinja2", interactive=False)
    return c
