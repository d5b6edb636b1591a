"""Kestrel Studio: the Gradio app over the job store and the engine (`python app.py`).

Layout (LLaMA-Factory's split): `interface.py` assembles the tabs; `components/<tab>.py` lays out
widgets and returns them by name; `handlers/<tab>.py` are plain functions (tests call them
directly); `events.py` binds widgets to handlers; every string shown lives in `strings.py`.
"""
