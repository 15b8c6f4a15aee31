"""The dashboard in a real browser: Debian's chromium driven by Playwright, against a server
started here on the demo model. Screenshots go to test-artifacts/dashboard/ (git-ignored; or
$COLIBRI_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.serve_util import running_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = (
    Path(
        os.environ.get("COLIBRI_TEST_ARTIFACTS")
        or Path(__file__).resolve().parents[1] / "test-artifacts"
    )
    / "dashboard"
)

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(
        sync_playwright is None, reason="playwright is not installed (pip install -e '.[test]')"
    ),
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM),
        reason="chromium is not installed (scripts/setup.sh test installs it as root: "
        "apt-get install chromium)",
    ),
]


@pytest.fixture(scope="module")
def server():
    # a budget of a third of the demo's experts: the heat map shows all three tiers
    with running_server(parallel=2, engine_options={"budget": 2 << 20}) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    pg = browser.new_page(viewport={"width": 1400, "height": 950})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.url + "/")
    pg.wait_for_function("document.getElementById('model').textContent.includes('colibri-demo')")
    pg.wait_for_function("state.snap !== null")
    yield pg
    pg.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def heat_pixels(pg) -> str:
    return pg.evaluate("document.getElementById('heatmap').toDataURL()")


def test_chat_streams_and_heat_map_changes(page, server):
    before_tokens = page.evaluate("state.snap.routed_tokens")
    before_pixels = heat_pixels(page)
    # record every length the answer goes through: tokens must arrive one chunk at a time
    page.evaluate(
        """window.lengths = [];
        new MutationObserver(() => {
          const b = document.querySelector('.msg.assistant .body');
          if (b) window.lengths.push(b.textContent.length);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});"""
    )
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "48")
    page.fill("#prompt", "Write a short story about a hummingbird.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .stats", timeout=60_000)
    stats = page.inner_text(".msg.assistant .stats")
    answer = page.inner_text(".msg.assistant .body")
    lengths = page.evaluate("window.lengths")
    assert answer.strip(), "no answer text"
    assert len({n for n in lengths if n > 0}) >= 3, f"the answer did not stream: {lengths}"
    for field in ("TTFT", "tok/s", "hit rate", "read/token"):
        assert field in stats, stats
    # the same request through the API gives the same greedy text (the page's own request)
    import httpx2 as httpx

    ref = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "colibri-demo",
            "messages": [{"role": "user", "content": "Write a short story about a hummingbird."}],
            "temperature": 0,
            "top_p": 0.95,
            "max_tokens": 48,
        },
        timeout=60,
    ).json()
    assert answer == ref["choices"][0]["message"]["content"]
    # the feed saw the routing, and the heat map was redrawn from it
    page.wait_for_function(f"state.snap.routed_tokens > {before_tokens}")
    page.wait_for_timeout(600)
    assert heat_pixels(page) != before_pixels
    recent = page.evaluate("state.snap.recent")
    assert sum(map(sum, recent)) > 0
    page.hover("#heatmap", position={"x": 60, "y": 10})
    tip = page.inner_text("#heattip")
    assert "layer 0 expert" in tip and "hit rate" in tip, tip
    page.screenshot(path=str(ARTIFACTS / "chat-and-heatmap.png"), full_page=True)
    page.locator("#heat").screenshot(path=str(ARTIFACTS / "heatmap.png"))
    page.locator("#time").screenshot(path=str(ARTIFACTS / "time.png"))
    series = page.evaluate("state.series.filter(p => p.tokens > 0).length")
    assert series > 0, "the time chart got no interval with tokens"


def test_stop_cancels_the_generation(page, server):
    page.check("#ignore_eos")
    page.fill("#max_tokens", "900")
    page.fill("#prompt", "Count forever.")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "(document.querySelector('.msg.assistant .body') || {textContent: ''})"
        ".textContent.length > 20"
    )
    assert page.is_enabled("#stop")
    page.screenshot(path=str(ARTIFACTS / "generating.png"))
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .stats", timeout=30_000)
    assert "stopped" in page.inner_text(".msg.assistant .stats")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    h = server.wait_idle(timeout=20)
    assert h["running"] == 0 and h["leased"] == 0, h
    gen = page.evaluate("fetch('/v1/experts').then(r => r.json())")["statistics"]
    assert gen["generated_tokens"] < 900 + 48 + 48  # the stopped one never reached 900


def test_atlas_loads_and_hover_shows_top_tokens(page, server):
    import httpx2 as httpx

    httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "colibri-demo", "messages": [{"role": "user", "content": "Hello"}]},
        timeout=60,
    )
    page.click("#atlasrefresh")
    page.wait_for_function(
        "document.getElementById('atlasinfo').textContent.includes('32 experts')"
    )
    page.locator("#atlas").scroll_into_view_if_needed()
    # hover the most used expert: its tooltip lists the tokens routed to it
    xy = page.evaluate(
        """(() => { const A = state.atlas; let best = 0;
        for (let i = 0; i < A.N; i++) if (A.tokens[i] > A.tokens[best]) best = i;
        const cv = document.getElementById('atlascanvas'); const r = cv.getBoundingClientRect();
        const [x, y] = atlasXY(best, cv.clientWidth, cv.clientHeight);
        return [r.left + x, r.top + y, A.layer[best], A.expert[best]]; })()"""
    )
    page.mouse.move(xy[0], xy[1])
    page.wait_for_function(
        "document.getElementById('atlastip').textContent.includes('most routed tokens')"
    )
    tip = page.inner_text("#atlastip")
    assert f"layer {xy[2]} expert {xy[3]}" in tip and "×" in tip, tip
    page.locator("#atlas").screenshot(path=str(ARTIFACTS / "atlas-demo.png"))


def synthetic_atlas(n_layers: int = 76, n_experts: int = 256, seed: int = 0) -> dict:
    """A GLM-5-sized layout (76 x 256 = 19,456 experts): clusters per layer and topic."""
    rng = np.random.default_rng(seed)
    layer = np.repeat(np.arange(n_layers), n_experts)
    expert = np.tile(np.arange(n_experts), n_layers)
    centre = rng.uniform(-0.7, 0.7, (8, 2))[expert % 8]
    xy = np.clip(centre + rng.normal(0, 0.08, (len(layer), 2)), -1, 1)
    return {
        "object": "expert_atlas",
        "model": "synthetic",
        "method": "synthetic",
        "routed_tokens": 123456,
        "num_layers": n_layers,
        "num_experts": n_experts,
        "points": {
            "x": np.round(xy[:, 0], 4).tolist(),
            "y": np.round(xy[:, 1], 4).tolist(),
            "layer": layer.tolist(),
            "expert": expert.tolist(),
            "tokens": rng.integers(0, 1000, len(layer)).tolist(),
        },
    }


def test_atlas_with_20k_experts(page):
    body = json.dumps(synthetic_atlas())
    page.route(
        "**/v1/experts/atlas",
        lambda route: route.fulfill(status=200, content_type="application/json", body=body),
    )
    page.click("#atlasrefresh")
    page.wait_for_function(
        "document.getElementById('atlasinfo').textContent.includes('19456 experts')"
    )
    page.locator("#atlas").scroll_into_view_if_needed()
    ms = page.evaluate(
        "(() => { const t = performance.now(); for (let i = 0; i < 5; i++) drawAtlas();"
        " return (performance.now() - t) / 5; })()"
    )
    print(f"atlas redraw with 19456 experts: {ms:.1f} ms")
    # painted: many non-background pixels
    lit = page.evaluate(
        """(() => { const cv = document.getElementById('atlascanvas');
        const d = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; })()"""
    )
    assert lit > 10_000, lit
    # hover finds a point through the grid index (the tooltip names a layer and expert)
    xy = page.evaluate(
        """(() => { const cv = document.getElementById('atlascanvas');
        const r = cv.getBoundingClientRect(); const [x, y] = atlasXY(12345, cv.clientWidth,
        cv.clientHeight); return [r.left + x, r.top + y]; })()"""
    )
    page.mouse.move(xy[0], xy[1])
    page.wait_for_function("document.getElementById('atlastip').textContent.includes('layer')")
    assert page.evaluate("state.hoverExpert") is not None
    page.locator("#atlas").screenshot(path=str(ARTIFACTS / "atlas-20k.png"))


def synthetic_snapshot(n_layers: int = 76, n_experts: int = 256, seed: int = 0) -> dict:
    """A /v1/experts snapshot of GLM-5's size with every tier present."""
    rng = np.random.default_rng(seed)
    shape = (n_layers, n_experts)
    recent = np.where(rng.random(shape) < 0.03, rng.integers(1, 64, shape), 0)
    state = rng.choice([0, 1, 2], size=shape, p=[0.6, 0.02, 0.38])
    gets = rng.integers(0, 100, shape)
    stats = dict.fromkeys(
        [
            "expert_hits", "expert_misses", "bytes_read", "reads", "evictions",
            "wait_io_seconds", "compute_seconds", "verify_seconds", "forward_steps",
            "prompt_tokens", "generated_tokens", "prefix_hits", "running", "waiting",
            "reads_in_flight", "leased", "cache_used_nbytes", "prefix_nbytes", "dense_nbytes",
        ],
        0,
    )  # fmt: skip
    stats.update(cache_budget_nbytes=1 << 30, hit_rate=1.0)
    return {
        "object": "experts", "model": "synthetic", "time": 1.0, "num_layers": n_layers,
        "num_experts": n_experts, "top_k": 8, "moe_layers": list(range(n_layers)),
        "recent_window": 64, "routed_tokens": 1, "recent": recent.tolist(),
        "tokens": recent.tolist(), "gets": gets.tolist(), "hits": (gets // 2).tolist(),
        "state": state.tolist(), "statistics": stats,
    }  # fmt: skip


def test_heat_map_with_20k_experts(browser, server):
    event = "data: " + json.dumps(synthetic_snapshot()) + "\n\n"
    pg = browser.new_page(viewport={"width": 1400, "height": 950})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.route(
        "**/v1/experts/stream*",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=event),
    )
    pg.goto(server.url + "/")
    pg.wait_for_function("state.snap !== null && state.snap.num_experts === 256")
    ms = pg.evaluate(
        "(() => { const t = performance.now(); for (let i = 0; i < 5; i++) drawHeat();"
        " return (performance.now() - t) / 5; })()"
    )
    print(f"heat map redraw with 19456 experts: {ms:.1f} ms")
    height = pg.evaluate("document.getElementById('heatmap').clientHeight")
    assert height > 76 * 2, height  # one row per layer
    # hover a cell: the tooltip names the layer and expert under the pointer
    box = pg.locator("#heatmap").bounding_box()
    pg.mouse.move(box["x"] + 34 + 100.5 * (box["width"] - 38) / 256, box["y"] + 4 + 2.5 * 4.7)
    tip = pg.inner_text("#heattip")
    assert "layer 2 expert 100" in tip, tip
    pg.locator("#heat").screenshot(path=str(ARTIFACTS / "heatmap-20k.png"))
    pg.close()
    assert not errors, errors
