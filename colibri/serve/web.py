"""`colibri web [STORE]`: `colibri serve` and the dashboard opened in a browser.

    colibri web                 # the demo model; opens http://127.0.0.1:8000/

Same options as `colibri serve`, plus --no-browser. Opening the browser uses Python's
webbrowser module; where none can be found (a headless machine) the URL is printed and the
server keeps running.
"""

from __future__ import annotations

import argparse
import sys
import threading

from colibri.serve import cli as serve_cli


def configure_parser(p: argparse.ArgumentParser) -> None:
    serve_cli.configure_parser(p)
    p.add_argument(
        "--no-browser", action="store_true", help="do not open a browser (print the URL only)"
    )


def open_browser(url: str) -> bool:
    """Open `url` in the user's browser from a helper thread (webbrowser may block on a
    console browser); False (and a message) when none is available. Never raises."""
    import webbrowser

    def go() -> None:
        try:
            ok = webbrowser.open(url, new=2)
        except Exception:  # a broken BROWSER variable, no display: never stop the server
            ok = False
        if not ok:
            print(f"colibri web: no browser found; open {url}", file=sys.stderr, flush=True)

    try:
        webbrowser.get()
    except webbrowser.Error:
        print(f"colibri web: no browser found; open {url}", file=sys.stderr, flush=True)
        return False
    threading.Thread(target=go, daemon=True, name="colibri-browser").start()
    return True


def run_cli(args: argparse.Namespace) -> int:
    def started(url: str) -> None:
        print(f"colibri web: dashboard at {url}", file=sys.stderr, flush=True)
        if not args.no_browser:
            open_browser(url)

    return serve_cli.run_cli(args, on_started=started)
