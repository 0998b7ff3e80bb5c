"""The dashboard (`/dashboard`) in a real browser: headless Chromium driven by Playwright,
against a daemon as users run it (`actord serve --http ... --api-key KEY`).

The browser is what this machine has: the `playwright` package (the `browser` extra) and a
Chromium executable (Debian's `chromium`, or $ACTORD_CHROMIUM); `scripts/bootstrap.sh`
installs both where it can, so CI has them. Nothing is installed here: where either is
missing the browser tests are skipped, saying which. The state route's refusals are
checked without a browser. ACTORD_DASHBOARD_SCREENSHOT=PATH saves the page as a PNG.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any, Iterator

import httpx
import pytest

from actord.frontends.client import Client
from actord.testing.models import write_tiny_llama
from tests.frontends.daemons import serving_http

KEY = "dash-key"
CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> str | None:
    named = os.environ.get("ACTORD_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    return next((p for p in map(shutil.which, CHROMIUMS) if p), None)


def browser_missing() -> str | None:
    """Why no browser test can run here, or None."""
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (pip install -e '.[browser]')")
    if chromium() is None:
        missing.append(f"a Chromium executable ({', '.join(CHROMIUMS)} on PATH, or ACTORD_CHROMIUM; "
                       "Debian: apt-get install chromium)")
    if not missing:
        return None
    return "no browser for the dashboard test: missing " + " and ".join(missing) + "; scripts/bootstrap.sh installs them"


@pytest.fixture
def expect() -> Any:
    """Playwright's `expect`, or the test skipped where this machine has no browser."""
    why = browser_missing()
    if why:
        pytest.skip(why)
    from playwright.sync_api import expect

    return expect


@contextlib.contextmanager
def live_page(url: str) -> Iterator[tuple[Any, Any]]:
    """Headless Chromium on the dashboard at 1280 x 860, with the key, once the page is live:
    the browser and the page."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium())
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.goto(url + f"/dashboard#key={KEY}")
            expect(page.locator("body")).to_have_attribute("data-state", "live", timeout=20000)
            yield browser, page
        finally:
            browser.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("dash")
    model = write_tiny_llama(d / "tiny.gguf", seed=1)
    with serving_http(model, d, "--api-key", KEY) as served:
        yield served


def turn(c: Client, mind: str, n: int = 4) -> None:
    c.call("completion", {"prompt": f"{mind} says hello to the dashboard", "n_predict": n, "mind": mind,
                          "ignore_eos": True})


def test_the_state_route_needs_the_key_and_the_page_holds_no_data(daemon):
    url, _ = daemon
    assert httpx.get(url + "/dashboard/state").status_code == 401
    assert httpx.get(url + "/dashboard/state", headers={"authorization": "Bearer nope"}).status_code == 401
    ok = httpx.get(url + "/dashboard/state", headers={"authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and {"slots", "minds", "budgets", "genes", "series"} <= set(ok.json())
    page = httpx.get(url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text  # nothing loaded from elsewhere


@pytest.mark.slow
def test_the_page_shows_a_mind_moving_from_a_slot_to_a_page_and_back(daemon, expect):
    url, c = daemon
    turn(c, "ada")
    with live_page(url) as (browser, page):
        assert "key=" not in page.url  # the key left the address bar
        # One row per mind and tier: a RAM page and the file written behind it are two rows,
        # so each check names its tier (by the name alone, two rows can match).
        def row(mind: str, tier: str) -> Any:
            return page.locator(f'#minds tr[data-mind="{mind}"][data-tier="{tier}"]')

        expect(row("ada", "slot")).to_have_count(1, timeout=20000)
        expect(page.locator('#slots tr[data-mind="ada"]')).to_have_count(1)

        turn(c, "bob")
        turn(c, "cy")  # two slots, three minds: the least recently used, ada, is paged out
        expect(row("ada", "page")).to_have_count(1, timeout=20000)
        expect(row("ada", "slot")).to_have_count(0)
        expect(page.locator('#slots tr[data-mind="ada"]')).to_have_count(0)
        expect(page.locator('#budgets [data-budget="page_ram"]')).to_contain_text("KiB")

        turn(c, "ada")  # and back into a slot, from her page
        expect(row("ada", "slot")).to_have_count(1, timeout=20000)
        expect(row("ada", "page")).to_have_count(0)
        expect(page.locator('#slots tr[data-mind="ada"]')).to_have_count(1)
        c.call("page.spill", {"page": "bob", "file": "bob.page", "drop": True})  # ada took bob's slot
        expect(row("bob", "file")).to_have_count(1, timeout=20000)
        expect(row("bob", "page")).to_have_count(0)
        for m in ("cy", "ada", "cy", "ada"):  # a little more traffic, polled, for the plots
            turn(c, m, 8)
            page.wait_for_timeout(700)  # a time window on purpose: the page polls, the plots need points apart
        shot = os.environ.get("ACTORD_DASHBOARD_SCREENSHOT")
        if shot:
            page.wait_for_timeout(1200)  # one more poll drawn before the picture (only when one is asked for)
            page.screenshot(path=shot, full_page=True)

        refused = browser.new_page()  # a tab of its own: no key in its session
        refused.goto(url + "/dashboard")
        expect(refused.locator("body")).to_have_attribute("data-state", "refused", timeout=20000)
        expect(refused.locator("#status")).to_contain_text("API key")
        expect(refused.locator('#minds tr[data-mind="ada"]')).to_have_count(0)


PREFIX = [1] + [3 + (i * 37) % 500 for i in range(599)]  # two prompts share it: a base (serving/page_bases.py)
LONG = "Ada Lovelace, Countess of Lovelace, who wrote the first program for the Analytical Engine"


def fits(page, width: int) -> list[str]:
    """What is wider than its box at this width: the document, or a card's content."""
    return page.evaluate("""(w) => {
        const out = [];
        if (document.documentElement.scrollWidth > w) out.push("document " + document.documentElement.scrollWidth);
        for (const s of document.querySelectorAll("section")) if (s.scrollWidth > s.clientWidth + 1)
            out.push(s.querySelector("h2").textContent + " " + s.scrollWidth + " > " + s.clientWidth);
        return out; }""", width)


@pytest.mark.slow
def test_the_page_shows_a_minds_label_its_shared_base_and_fits_1280_px(daemon, expect):
    url, c = daemon
    for slot in (0, 1):
        c.call("slot.erase", {"slot": slot})
    for slot, tail in ((0, [7, 8, 9]), (1, [90, 91, 92])):
        c.call("completion", {"prompt": PREFIX + tail, "n_predict": 2, "slot": slot, "ignore_eos": True})
    c.call("page.out", {"slot": 0, "page": "pa"})  # slot 1 shares the prefix: pa is made a base and a rest
    c.call("page.out", {"slot": 1, "page": "pb"})  # and pb stands on that base
    r = httpx.post(url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"prompt": "a mind a client named", "max_tokens": 2, "user": LONG})
    assert r.status_code == 200, r.text
    with live_page(url) as (browser, page):
        # Her row as a slot's mind: write-behind may list her file too, a second row of hers.
        labelled = page.locator(f'#minds tr[data-label="{LONG}"][data-tier="slot"]')
        expect(labelled).to_have_count(1, timeout=20000)
        expect(labelled).to_contain_text("Ada Lovelace")
        assert labelled.get_attribute("data-mind").startswith("u-")  # the digest, shown beneath
        base = page.locator("#bases tr[data-base]")
        expect(base).to_have_count(1, timeout=20000)
        assert base.get_attribute("data-pages") == "pa,pb"
        expect(base).to_contain_text("600")  # the tokens the two pages share, held once
        expect(page.locator('#minds tr[data-mind="pb"] .based')).to_have_count(1)
        assert fits(page, 1280) == []
        shot = os.environ.get("ACTORD_DASHBOARD_SCREENSHOT")
        if shot:
            page.screenshot(path=shot.replace(".png", "-bases.png"), full_page=True)


def test_rates_come_from_the_counters_between_polls():
    from actord.frontends.http.dashboard import series

    a = {"predicted_tokens_total": 10.0, "prompt_tokens_total": 100.0, "prompt_tokens_processed_total": 40.0,
         "prompt_tokens_cached_total": 60.0, "first_token_seconds_sum": 1.0, "first_token_seconds_count": 2.0}
    b = {**a, "predicted_tokens_total": 30.0, "prompt_tokens_total": 150.0, "prompt_tokens_processed_total": 50.0,
         "prompt_tokens_cached_total": 100.0, "first_token_seconds_sum": 1.5, "first_token_seconds_count": 4.0}
    c = dict(b)
    out = series([(0.0, a), (2.0, b), (3.0, c)])
    assert out[0] == {"t": -1.0, "tokens_per_s": 10.0, "first_token_ms": 250.0, "prompt_processed": 10.0,
                      "prompt_cached": 40.0}
    assert out[1]["first_token_ms"] is None and out[1]["tokens_per_s"] == 0.0
