"""Starting Kestrel Studio (`python app.py`, or `kestrel-studio` once installed).

    python app.py                                   # http://127.0.0.1:7860, this machine only
    python app.py --host 0.0.0.0 --auth me:secret   # reachable from the network: a login is required
    python app.py --share --auth me:secret          # a public Gradio link (the only outside connection)
    python app.py --allow-custom-rewards            # GRPO may run reward code from a .py file you name

Training and exports run as jobs in worker processes that outlive the browser tab and the studio
itself (the job store, KESTREL_HOME/kestrel.db); reopen the page to see them live. The Chat tab
loads the model it talks to in the studio's own process.
It works offline with the built-in demo model and the sample datasets. Gradio's analytics and
version check are off, and the page loads no web fonts.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading

from kestrel.studio.settings import StudioSettings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kestrel-studio", description="Kestrel Studio")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--auth", metavar="USER:PASSWORD", help="require this login (needed off loopback and with --share)")
    p.add_argument("--share", action="store_true", help="also serve through a public gradio.live link")
    from kestrel.studio.files import DEFAULT_MAX_UPLOAD_MB

    p.add_argument("--max-upload-mb", type=float, default=DEFAULT_MAX_UPLOAD_MB,
                   help=f"largest dataset upload in MiB (default {DEFAULT_MAX_UPLOAD_MB:.0f})")
    p.add_argument("--allow-custom-rewards", action="store_true",
                   help="let GRPO runs started here import a reward from a .py file (it runs with your permissions; "
                        "anyone who can log in to the studio can then run code)")
    args = p.parse_args(argv)
    args.auth_pair = check_access(args.host, args.share, args.auth, p.error)
    if not 0 < args.port < 65536:
        p.error(f"--port must be 1..65535, got {args.port}")
    if args.max_upload_mb <= 0:
        p.error("--max-upload-mb must be positive")
    return args


def check_access(host: str, share: bool, auth: str | None, fail: object) -> tuple[str, str] | None:
    """The (user, password) pair; `fail(message)` when the settings would expose the studio
    without a login or the login is malformed."""
    pair = None
    if auth is not None:
        user, sep, password = auth.partition(":")
        if not sep or not user or not password:
            fail("--auth must be USER:PASSWORD with both parts non-empty")  # type: ignore[operator]
        pair = (user, password)
    if pair is None and (share or host not in LOOPBACK):
        where = "--share" if share else f"--host {host}"
        fail(f"{where} makes the studio reachable from other machines: add --auth USER:PASSWORD")  # type: ignore[operator]
    return pair


def studio_settings(args: argparse.Namespace) -> StudioSettings:
    """The parsed options the handlers need, as the object `build_app` passes down."""
    return StudioSettings(max_upload_mb=args.max_upload_mb, allow_custom_rewards=args.allow_custom_rewards)


def configure_environment() -> None:
    """Settings that must be in place before Gradio or Hugging Face libraries are imported."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kestrel.studio.files import gradio_tmp_dir

    os.environ["GRADIO_TEMP_DIR"] = str(gradio_tmp_dir())  # uploads stay inside KESTREL_HOME


def warm_up() -> None:
    """Import the heavy modules and read the demo tokenizer in the background, so the first
    click on a dataset or the memory estimate does not wait for them."""
    try:
        import kestrel.data  # noqa: F401 - imported for its import time
        from kestrel.studio.handlers.common import tokenizer_for
        from kestrel.studio.handlers.train import _gpu

        tokenizer_for("demo")
        _gpu()
    except Exception as exc:  # noqa: BLE001 - a failed warm-up only costs the first click time
        logging.getLogger("kestrel.studio").warning("warm-up failed: %s", exc)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_environment()
    from kestrel.studio.files import served_dirs
    from kestrel.studio.interface import CSS, build_app, theme

    threading.Thread(target=warm_up, name="warm-up", daemon=True).start()
    app = build_app(studio_settings(args))
    app.queue(default_concurrency_limit=8)  # twenty polling browsers must not wait in one line
    app.launch(
        server_name=args.host, server_port=args.port, auth=args.auth_pair, share=args.share,
        max_file_size=f"{int(args.max_upload_mb * 1024)}kb", allowed_paths=served_dirs(),
        ssr_mode=False, mcp_server=False, show_error=False, theme=theme(), css=CSS,
        # Gradio's run history copies every event's inputs and outputs (the whole form, chart data)
        # into localStorage and rewrites up to 100 of them on each event: every edit got slower as it
        # filled, and it would keep users' paths and configs in the browser.
        run_history=False,
    )
    return 0

