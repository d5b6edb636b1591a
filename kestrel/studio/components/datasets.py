"""Datasets tab layout: upload or pick a sample, format and column mapping, preview, validation
report, token-length histogram, token preview of one row."""

from __future__ import annotations

import gradio as gr

from kestrel.studio import strings as S
from kestrel.studio.files import DATASET_EXTENSIONS
from kestrel.studio.handlers.datasets import format_choices, roles

TOKEN_COLORS = {S.DS_TOKEN_LABELS["trained"]: "#16a34a", S.DS_TOKEN_LABELS["masked"]: "#9ca3af",
                S.DS_TOKEN_LABELS["cut"]: "#dc2626"}


def build() -> dict[str, gr.Component]:
    c: dict[str, gr.Component] = {"state": gr.State({})}
    with gr.Row():
        with gr.Column(scale=1, min_width=280):
            c["upload"] = gr.File(label=S.DS_UPLOAD, file_types=list(DATASET_EXTENSIONS), type="filepath",
                                  elem_id="ds-upload")
            c["sample"] = gr.Dropdown(label=S.DS_SAMPLES, choices=[], elem_id="ds-sample")
            c["use_sample"] = gr.Button(S.DS_USE_SAMPLE, size="sm")
            c["datasets"] = gr.Dropdown(label=S.DS_REGISTERED, choices=[], elem_id="ds-registered")
            c["open"] = gr.Button(S.DS_OPEN, size="sm")
        with gr.Column(scale=2):
            c["status"] = gr.Markdown(elem_id="ds-status")
            c["summary"] = gr.Markdown(elem_id="ds-summary")
            c["truncation"] = gr.Markdown(elem_id="ds-truncation")
            c["format"] = gr.Dropdown(label=S.DS_FORMAT, info=S.DS_FORMAT_INFO, choices=format_choices(),
                                      value="auto", elem_id="ds-format")
            with gr.Row():
                for role in roles():
                    c[f"col_{role}"] = gr.Dropdown(label=role, choices=[], visible=False, min_width=120,
                                                   elem_id=f"ds-col-{role}")
            c["apply_mapping"] = gr.Button(S.DS_APPLY_MAPPING, size="sm")
    c["preview"] = gr.Dataframe(label=S.DS_PREVIEW, interactive=False, wrap=True, max_height=360,
                                elem_id="ds-preview")
    with gr.Row():
        c["report"] = gr.Dataframe(label=S.DS_REPORT, interactive=False, wrap=True, max_height=300,
                                   headers=["line", "reason"], elem_id="ds-report")
        # sort=[]: bars in the frame's order (buckets by length), fixed once. A `sort` sent with each
        # new value made Gradio redraw the plot with the previous dataset's data.
        c["histogram"] = gr.BarPlot(x="tokens", y="rows", label=S.DS_HISTOGRAM, height=260, y_lim=[0, None],
                                    sort=[], x_label_angle=-30, elem_id="ds-hist")
    with gr.Row():
        c["row"] = gr.Number(label=S.DS_TOKEN_ROW, value=1, precision=0, minimum=1, scale=0, min_width=200,
                             elem_id="ds-row")
        c["token_summary"] = gr.Markdown(elem_id="ds-token-summary")
    c["tokens"] = gr.HighlightedText(label=S.DS_TOKENS, color_map=TOKEN_COLORS, combine_adjacent=True,
                                     show_legend=True, elem_id="ds-tokens")
    return c
