"""Export tab layout: run, format, quantization, Export, progress, download and Modelfile."""

from __future__ import annotations

import gradio as gr

from studio import strings as S


def build() -> dict[str, gr.Component]:
    c: dict[str, gr.Component] = {}
    with gr.Row():
        c["source"] = gr.Dropdown(label=S.EX_RUN, choices=[], scale=3, elem_id="ex-source")
        c["refresh"] = gr.Button(S.CH_REFRESH, size="sm", scale=1)
    with gr.Row():
        c["format"] = gr.Radio(label=S.EX_FORMAT, choices=[(v, k) for k, v in S.EX_FORMATS.items()],
                               value="gguf", elem_id="ex-format")
        c["quant"] = gr.Dropdown(label=S.EX_QUANT, choices=[], elem_id="ex-quant")
    c["start"] = gr.Button(S.EX_START, variant="primary", elem_id="ex-start")
    c["status"] = gr.Markdown(elem_id="ex-status")
    c["file"] = gr.File(label=S.EX_FILE, file_count="multiple", interactive=False, elem_id="ex-file")
    c["modelfile"] = gr.Code(label=S.EX_MODELFILE, language="dockerfile", interactive=False, elem_id="ex-modelfile")
    return c
