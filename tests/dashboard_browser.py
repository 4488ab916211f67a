"""Serve TensorBoard logs and load the Custom Scalars page in headless Chromium.

Used by ``tests/test_callback_dashboard.py``; also refreshes the README's screenshot::

    python3 -m tests.dashboard_browser lightning_logs/quickstart docs/dashboard-custom-scalars.png

Needs Debian's ``chromium`` (``apt-get install -y chromium``) and ``python3 -m pip install
playwright`` (driving the system browser: no ``playwright install``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional
from urllib.parse import parse_qs, urlparse

from tests.distributed_runs import free_port

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def chromium_path() -> Optional[str]:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> Optional[str]:
    """Why the browser test cannot run here (``None``: it can)."""
    if chromium_path() is None:
        return "no chromium on PATH (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (python3 -m pip install playwright)"
    return None


@contextmanager
def tensorboard(logdir: str, timeout_s: float = 120.0) -> Iterator[str]:
    """A TensorBoard server on 127.0.0.1 for ``logdir``; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(url + "/data/runs", timeout=2).read()
                break
            except OSError as err:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tensorboard did not start: {proc.stderr.read().decode()[-2000:]}") from err
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@dataclass
class Page:
    sections: dict[str, int]  # section title -> number of chart cards in it
    data: dict[str, set] = field(default_factory=dict)  # tag regex -> runs whose response had points


def load_custom_scalars(url: str, screenshot: str, settle_s: float = 60.0) -> Page:
    """Open the Custom Scalars page (smoothing off, outliers kept in the scale), wait for
    its charts' data, screenshot it."""
    from playwright.sync_api import sync_playwright

    data: dict[str, set] = {}

    def on_response(response) -> None:
        if "/data/plugin/custom_scalars/scalars" not in response.url:
            return
        query = parse_qs(urlparse(response.url).query)
        try:
            body = json.loads(response.body())
        except Exception:
            return
        points = [events for events in (body.get("tag_to_events") or {}).values() if events]
        data.setdefault(query["tag"][0], set())
        if points:
            data[query["tag"][0]].add(query["run"][0])

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 2000})
            page.on("response", on_response)
            page.goto(url + "/#custom_scalars&_smoothingWeight=0")
            cards = page.locator("tf-custom-scalar-multi-line-chart-card")
            cards.first.wait_for(timeout=settle_s * 1000)
            outliers = page.get_by_text("Ignore outliers in chart scaling")
            if outliers.count():
                outliers.first.click()  # keep the sparse baseline samples inside the charts' scale
            deadline = time.monotonic() + settle_s
            expected = cards.count()
            while time.monotonic() < deadline and len(data) < expected:
                page.wait_for_timeout(500)
            page.wait_for_timeout(2000)  # let the last charts draw
            sections = {}
            for pane in page.locator("tf-category-paginated-view").all():
                title = pane.evaluate("el => el.category ? el.category.name : ''")
                sections[title] = pane.locator("tf-custom-scalar-multi-line-chart-card").count()
            page.screenshot(path=screenshot, full_page=True)
        finally:
            browser.close()
    return Page(sections, data)


if __name__ == "__main__":
    logdir, out = sys.argv[1], sys.argv[2]
    with tensorboard(logdir) as url:
        print(load_custom_scalars(url, out))
