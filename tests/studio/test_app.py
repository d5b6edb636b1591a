"""`python app.py`: who may reach the studio, and the assembled app (tabs, no outside fonts)."""

from __future__ import annotations

import pytest

from kestrel.studio import launch as app


@pytest.mark.parametrize("argv", [["--host", "0.0.0.0"], ["--share"], ["--host", "192.168.1.5"],
                                  ["--host", "0.0.0.0", "--auth", "user"], ["--auth", ":pw"], ["--port", "0"]])
def test_exposed_without_a_login_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        app.parse_args(argv)
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "--auth" in err or "--port" in err


@pytest.mark.parametrize("argv, pair", [([], None), (["--host", "localhost"], None),
                                        (["--host", "0.0.0.0", "--auth", "me:s3:cret"], ("me", "s3:cret")),
                                        (["--share", "--auth", "a:b"], ("a", "b"))])
def test_allowed_settings(argv: list[str], pair: tuple[str, str] | None) -> None:
    args = app.parse_args(argv)
    assert args.auth_pair == pair


def test_environment_keeps_everything_local(kestrel_home, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GRADIO_ANALYTICS_ENABLED", "GRADIO_TEMP_DIR"):
        monkeypatch.delenv(name, raising=False)
    app.configure_environment()
    import os

    assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "False"
    assert os.environ["GRADIO_TEMP_DIR"].startswith(str(kestrel_home))


def test_app_has_the_five_tabs_and_system_fonts() -> None:
    from kestrel.studio.interface import build_app, theme

    config = build_app().get_config_file()
    tabs = [c["props"].get("label") for c in config["components"] if c["type"] == "tabitem"]
    assert tabs == ["Datasets", "Train", "Runs", "Chat", "Export"]
    fonts = theme()._font + theme()._font_mono
    assert all(isinstance(f, str) for f in fonts)  # system fonts: nothing fetched from a font service


def test_polling_timers_start_off_and_follow_their_tab() -> None:
    """A browser parked on another tab must not poll the store (twenty open tabs would)."""
    from kestrel.studio.events import _timers_for
    from kestrel.studio.interface import build_app

    config = build_app().get_config_file()
    timers = [c for c in config["components"] if c["type"] == "timer"]
    assert len(timers) >= 2 and not any(t["props"].get("active") for t in timers)
    for tab, want in (("runs", (True, False)), ("export", (False, True)), ("train", (False, False))):
        runs_timer, export_timer = _timers_for(tab)
        assert (runs_timer.active, export_timer.active) == want


def test_every_event_keeps_its_loading_state_on_a_few_small_components() -> None:
    """Gradio's page re-applies the loading state of every progress target any event has named
    (by default all its outputs) on each status message of every event, each after a walk of the
    layout and a deep copy of the component's value: the studio's 125 outputs made that most of an
    edit's time. Every event names its targets: the header, or a tab's status line."""
    from kestrel.studio.interface import build_app

    config = build_app().get_config_file()
    components = {c["id"]: c for c in config["components"]}
    backend = [d for d in config["dependencies"] if d["backend_fn"]]
    assert backend and all(d["show_progress_on"] for d in backend), \
        [d["targets"] for d in backend if not d["show_progress_on"]]
    targets = {i for d in backend for i in d["show_progress_on"]}
    assert {components[i]["type"] for i in targets} == {"markdown"}
    header = config["layout"]["children"][0]["id"]  # first in the layout: found at once
    assert header in targets and len(targets) <= 1 + 5  # the header, at most a status line per tab
    quiet = [d for d in backend if d["show_progress"] == "hidden"]
    assert quiet and all(d["show_progress_on"] == [header] for d in quiet)


def test_an_event_without_progress_targets_is_refused() -> None:
    import gradio as gr

    from kestrel.studio.events import Outputs, _on

    with gr.Blocks():
        box, out = gr.Textbox(), gr.Markdown()
        with pytest.raises(TypeError, match="show_progress_on"):
            _on(box.input, lambda v: {"out": v}, [box], Outputs([("out", out)]))


def test_polling_follows_the_tab_the_page_shows_not_the_event_that_came_last() -> None:
    """Gradio also sends the first tab's select as the page mounts, after a quick click on another
    tab: the timers' handler takes the shown tab from the page (one event for all tabs), so that
    late select cannot switch the Runs tab's polling off."""
    from kestrel.studio.events import SHOWN_TAB_JS
    from kestrel.studio.interface import build_app

    config = build_app().get_config_file()
    components = {c["id"]: c for c in config["components"]}
    timers = {i for i, c in components.items() if c["type"] == "timer"}
    switching = [d for d in config["dependencies"] if set(d["outputs"]) == timers]
    assert len(switching) == 1, "one event switches the timers"
    dep = switching[0]
    assert dep["js"] == SHOWN_TAB_JS and [components[i]["type"] for i in dep["inputs"]] == ["textbox"]
    assert sorted(components[t[0]]["props"]["id"] for t in dep["targets"]) == sorted(
        c["props"]["id"] for c in components.values() if c["type"] == "tabitem")


@pytest.mark.parametrize("choice, describes, fields", [
    ("ch-target", {"ch-checkpoint", "ch-left", "ch-right", "ch-note"},
     [("ch-checkpoint", "input"), ("ch-side", "input"), ("ch-target", "input")]),
    ("ex-source", {"ex-checkpoint", "ex-quant"},
     [("ex-checkpoint", "input"), ("ex-format", "input"), ("ex-source", "input")]),
])
def test_a_choice_is_described_by_whatever_sets_it(choice: str, describes: set[str], fields: list) -> None:
    """The Chat panels and weights, and Export's weights and sizes, describe the choice above them.
    Every event that sets the choice's list (tab open, Refresh) describes it in the same answer;
    the page load does not set it (its slow answer came after the tab's, in CI, and put back a list
    read before a run finished); the one event that describes on its own follows the user's input on the fields it
    depends on, never a change an answer made, one at a time with the latest trigger last. A
    describe chained on a change event was overtaken under load: a stale answer stayed (Export's
    weights list never appeared; Chat's right panel hidden under a ticked box)."""
    from kestrel.studio.interface import build_app

    config = build_app().get_config_file()
    components = {c["id"]: c for c in config["components"]}
    ids = {c["props"].get("elem_id"): i for i, c in components.items()}
    wanted = {ids[e] for e in describes}
    setting = [d for d in config["dependencies"] if ids[choice] in d["outputs"]]
    triggers = {t for d in setting for _, t in d["targets"]}
    assert triggers >= {"select", "click"} and "load" not in triggers, triggers
    for dep in setting:
        assert wanted <= set(dep["outputs"]), f"an event setting {choice} ({dep['targets']}) leaves out some of {describes}"
    describing = [d for d in config["dependencies"] if wanted <= set(d["outputs"]) and ids[choice] not in d["outputs"]]
    assert len(describing) == 1, f"one event describes {choice} on its own"
    dep = describing[0]
    assert dep["trigger_mode"] == "always_last"
    assert sorted((components[i]["props"].get("elem_id"), t) for i, t in dep["targets"]) == fields


def test_the_evaluation_section_holds_its_settings_and_start_reads_them() -> None:
    """The Train tab's Evaluation accordion has a widget for each evaluation setting, and Start and
    the live preview take them as inputs (a setting shown but not read would be silently lost)."""
    from kestrel.studio.form import FIELDS
    from kestrel.studio.interface import build_app

    config = build_app().get_config_file()
    components = {c["id"]: c for c in config["components"]}
    ids = {c["props"].get("elem_id"): i for i, c in components.items()}
    wanted = {ids["tr-" + f.key.replace(".", "-").replace("_", "-")] for f in FIELDS if f.section == "evaluation"}
    assert len(wanted) == 6

    def inside(node: dict, found: bool) -> set[int]:
        here = found or node["id"] == ids["tr-evaluation"]
        return ({node["id"]} if here else set()) | {i for child in node.get("children", []) for i in inside(child, here)}

    assert wanted <= inside(config["layout"], False)
    start = [d for d in config["dependencies"] if (ids["tr-start"], "click") in [tuple(t) for t in d["targets"]]]
    assert start and all(wanted <= set(d["inputs"]) for d in start)
    previews = [d for d in config["dependencies"] if ids["tr-yaml"] in d["outputs"] and wanted & set(d["inputs"])]
    assert previews and all(wanted <= set(d["inputs"]) for d in previews)
