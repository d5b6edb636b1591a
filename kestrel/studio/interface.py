"""Assembles the studio: five tabs laid out by `kestrel.studio.components`, wired by `kestrel.studio.events`.

    app = build_app(StudioSettings(max_upload_mb=512))
    app.launch(**launch_options(...))   # app.py does this
"""

from __future__ import annotations

import gradio as gr

from kestrel.studio import events
from kestrel.studio import strings as S
from kestrel.studio.components import chat, datasets, export, runs, train
from kestrel.studio.models import ModelPool
from kestrel.studio.settings import StudioSettings

# System fonts only: Gradio's default theme fetches web fonts, and the studio makes no outside
# connections.
SANS = ["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"]
MONO = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]
CSS = """
#ru-progress, #ds-summary, #tr-vram {min-height: 1.5em}
footer {display: none !important}
"""


def theme() -> gr.themes.Base:
    return gr.themes.Default(font=SANS, font_mono=MONO)


def build_app(settings: StudioSettings | None = None) -> gr.Blocks:
    """The studio as a gr.Blocks, not yet launched."""
    settings = settings or StudioSettings()
    pool = ModelPool(settings.loaded_models)
    # delete_cache: Gradio's copies of uploads and downloads older than a day go, checked hourly.
    with gr.Blocks(title=S.TITLE, analytics_enabled=False, delete_cache=(3600, 86400)) as app:
        # The header also keeps the (hidden) loading state of every quiet event: see events.hidden.
        header = gr.Markdown(f"## {S.TITLE}\n{S.SUBTITLE}")
        shown_tab = gr.Textbox(visible=False)  # the tab on screen, read from the page (events.SHOWN_TAB_JS)
        with gr.Tabs() as tabs:
            with gr.Tab(S.TAB_DATASETS, id="datasets") as datasets_tab:
                d = datasets.build()
            with gr.Tab(S.TAB_TRAIN, id="train") as train_tab:
                t = train.build(settings.allow_custom_rewards)
            with gr.Tab(S.TAB_RUNS, id="runs") as runs_tab:
                r = runs.build()
            with gr.Tab(S.TAB_CHAT, id="chat") as chat_tab:
                ch = chat.build()
            with gr.Tab(S.TAB_EXPORT, id="export") as export_tab:
                ex = export.build()
        events.wire_datasets(d, t, datasets_tab, settings, header)
        events.wire_train(t, r, tabs, settings, header)
        events.wire_runs(r, header)
        events.wire_chat(ch, pool, header)
        events.wire_export(ex, header)
        events.wire_tab_switches({"datasets": datasets_tab, "train": train_tab, "runs": runs_tab,
                                  "chat": chat_tab, "export": export_tab}, shown_tab, t, r, ch, ex, header)
        events.wire_load(app, d, t, r, settings, header)
    return app
