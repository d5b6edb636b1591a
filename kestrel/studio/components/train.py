"""Train tab layout: preset, model, method, dataset, the main hyperparameters, advanced,
evaluation and GRPO sections (built from `kestrel.studio.form.FIELDS`), memory estimate, Start, and the run's YAML."""

from __future__ import annotations

import gradio as gr

from kestrel.studio import strings as S
from kestrel.studio.form import FIELDS, REWARD_COLUMNS, Field
from kestrel.training.estimate import COMMON_GPUS_MIB


def _widget(field: Field) -> gr.Component:
    label = S.FIELD_LABELS.get(field.key, field.key)
    eid = "tr-" + field.key.replace(".", "-").replace("_", "-")
    if field.kind == "bool":
        return gr.Checkbox(label=label, elem_id=eid)
    if field.kind == "choice":
        return gr.Dropdown(label=label, choices=list(field.choices), elem_id=eid)
    if field.kind == "multi":
        return gr.CheckboxGroup(label=label, choices=list(field.choices), elem_id=eid)
    if field.kind == "rewards":
        return gr.Dataframe(label=label, headers=list(REWARD_COLUMNS), datatype=["str", "number", "str", "number", "str"],
                            column_count=len(REWARD_COLUMNS), column_limits=(len(REWARD_COLUMNS), len(REWARD_COLUMNS)),
                            row_count=1, interactive=True, elem_id=eid)
    if field.kind in ("text", "opt_text"):
        return gr.Textbox(label=label, elem_id=eid)
    if field.kind == "devices":  # the GPUs jobs may use, named so the user can pick among them
        from kestrel.jobs import available_devices

        found = [d for d in available_devices() if d != "cpu"]
        info = S.TR_DEVICES_FOUND.format(gpus=", ".join(found)) if found else S.TR_DEVICES_NONE
        return gr.Textbox(label=label, info=info, elem_id=eid)
    precision = 0 if field.kind.endswith("int") else None
    return gr.Number(label=label, step=field.step or 1e-5, precision=precision, elem_id=eid, min_width=140)


def _fields(c: dict[str, gr.Component], section: str, per_row: int = 4) -> None:
    chosen = [f for f in FIELDS if f.section == section]
    for i in range(0, len(chosen), per_row):
        with gr.Row():
            for field in chosen[i:i + per_row]:
                c[field.key] = _widget(field)


def _preference_section(c: dict[str, gr.Component]) -> None:
    """The settings of the preference methods (DPO, ORPO, SimPO, KTO) and what data they take."""
    with gr.Accordion(S.TR_PREFERENCE, open=False, elem_id="tr-preference"):
        _fields(c, "preference")
        gr.Markdown(S.TR_PREFERENCE_INFO)


def build(allow_custom_rewards: bool = False) -> dict[str, gr.Component]:
    """The tab's widgets by name; `allow_custom_rewards` (the studio's launch setting) is shown, not editable."""
    c: dict[str, gr.Component] = {"extra": gr.State({})}
    with gr.Row():
        c["preset"] = gr.Dropdown(label=S.TR_PRESET, choices=[(v, k) for k, v in S.PRESET_NAMES.items()],
                                  value="demo", scale=3, elem_id="tr-preset")
        c["apply_preset"] = gr.Button(S.TR_APPLY_PRESET, scale=1, size="sm")
    with gr.Row():
        c["model_source"] = gr.Radio(label=S.TR_MODEL_SOURCE, choices=[(v, k) for k, v in S.TR_MODEL_SOURCES.items()],
                                     value="demo", elem_id="tr-model-source")
        c["model"] = gr.Dropdown(label=S.TR_MODEL, info=S.TR_MODEL_INFO, choices=[], value="", allow_custom_value=True,
                                 visible=False, scale=2, elem_id="tr-model")
    with gr.Row():
        c["method"] = gr.Dropdown(label=S.TR_METHOD, choices=[(v, k) for k, v in S.TR_METHODS.items()],
                                  value="lora", elem_id="tr-method")
        c["dataset"] = gr.Dropdown(label=S.TR_DATASET, choices=[], allow_custom_value=True, scale=2,
                                   elem_id="tr-dataset")
    _fields(c, "main")
    c["vram"] = gr.Markdown(elem_id="tr-vram")
    # Shown on page load where no GPU is found (kestrel.studio.handlers.train.gpu_picker).
    c["gpu"] = gr.Dropdown(label=S.TR_GPU, choices=list(COMMON_GPUS_MIB), value=None, visible=False, elem_id="tr-gpu")
    with gr.Accordion(S.TR_ADVANCED, open=False):
        _fields(c, "advanced")
    with gr.Accordion(S.TR_EVALUATION, open=False, elem_id="tr-evaluation"):
        _fields(c, "evaluation", per_row=3)
        gr.Markdown(S.TR_EVALUATION_INFO)
    with gr.Accordion(S.TR_GRPO, open=False):
        _fields(c, "grpo")
        gr.Markdown(S.TR_REWARDS_INFO)
        c["custom_rewards"] = gr.Markdown(S.TR_CUSTOM_ON if allow_custom_rewards else S.TR_CUSTOM_OFF,
                                          elem_id="tr-custom-rewards")
    _preference_section(c)
    with gr.Row():
        c["start"] = gr.Button(S.TR_START, variant="primary", elem_id="tr-start")
    c["status"] = gr.Markdown(elem_id="tr-status")
    with gr.Accordion(S.TR_YAML, open=False):
        c["yaml"] = gr.Code(language="yaml", interactive=True, elem_id="tr-yaml")
        with gr.Row():
            c["apply_yaml"] = gr.Button(S.TR_APPLY_YAML, size="sm")
            c["load_yaml"] = gr.UploadButton(S.TR_LOAD_YAML, file_types=[".yaml", ".yml"], size="sm")
            c["download"] = gr.DownloadButton(S.TR_DOWNLOAD_YAML, size="sm", elem_id="tr-download")
    return c
