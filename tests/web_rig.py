"""What the browser tests share (tests/test_web_page.py, tests/test_web_speculation.py):
Debian's Chromium, headless, driven by Playwright for Python (never a downloaded
browser; tests/install_chromium.sh installs it), as the module-scoped `browser` fixture,
which skips, saying why, where Chromium is missing (playwright is a test extra); and the steps a test takes on the chat
page (docs/serving.md, "The chat page")."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
from playwright.sync_api import expect, sync_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip("no Chromium (apt-get install chromium; the README's test command does)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def open_page(browser, server, width=1200, height=800):
    """A fresh browser context (empty storage) on the server's page, ready. Any request
    that leaves the server, a page error or a load the Content-Security-Policy refused
    fails the test (`close`)."""
    context = browser.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
    page = context.new_page()
    problems = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("console", lambda m: problems.append(m.text) if m.text.startswith("Refused to") else None)
    page.on("request", lambda r: problems.append(f"outside request {r.url}")
            if not r.url.startswith((server.url, "data:", "blob:")) else None)
    page.problems = problems
    page.goto(server.url + "/")
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    return page


def close(page, tmp_path, name):
    page.screenshot(path=str(tmp_path / f"{name}.png"))
    problems = page.problems
    page.context.close()
    assert not problems, "\n".join(problems)


def send(page, text):
    page.fill("#input", text)
    page.press("#input", "Enter")


def settle(page):
    """Waits for the streamed reply to end (the stop button hides)."""
    expect(page.locator(".message.assistant").last.locator(".meta")).to_contain_text(re.compile("finish|stopped"))
    expect(page.locator("#stop")).to_be_hidden()


def set_setting(page, element_id, value):
    page.click("#tabs button[data-tab=settings]")
    if isinstance(value, bool):
        page.set_checked(f"#{element_id}", value)
    else:
        page.fill(f"#{element_id}", str(value))
        page.dispatch_event(f"#{element_id}", "change")
    page.click("#tabs button[data-tab=chat]")


def stored(page):
    return json.loads(page.evaluate("localStorage.getItem('monolith.conversations')"))


def current_messages(page):
    state = stored(page)
    return next(c for c in state["conversations"] if c["id"] == state["current"])["messages"]


def wait_for(condition, what, timeout=20):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
