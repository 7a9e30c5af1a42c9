"""The page at `/` in headless Chromium against real `kvflow serve` processes: a typed message
streams an answer; a long request shows in the running list and holds blocks in the KV map,
which turn free or cached when it ends; with --api-key the page asks for the key and the
snapshot endpoint refuses a client without it.

Needs Debian's `chromium` (`make test` installs it when run as root) and Playwright for
Python; skipped, saying so, without them."""

from __future__ import annotations

import json
import os
import shutil
import threading

import httpx
import pytest

from support.serverproc import start_server

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is missing")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(
        "no browser: install Debian's chromium package (apt-get install chromium; "
        "`make test` does it when run as root) to run the page's tests",
        allow_module_level=True,
    )

BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 120_000  # generous: the test machine may be shared and slow
KEY = "page-test-key"


@pytest.fixture(scope="module")
def server(placement: str):
    """One server for the module, with --api-key (a start-up is the costly part)."""
    srv = start_server("--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    # launch() gives Chromium a fresh temporary user-data-dir, removed on close
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
        yield chromium
        chromium.close()


def _page(browser, key: str | None):
    """A page in a fresh context (its own localStorage); with `key`, the page finds it stored,
    as after a person typed it once."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    if key is not None:
        context.add_init_script(f"localStorage.setItem('kvflow.page.v1.key', {json.dumps(key)})")
    return context, context.new_page()


@pytest.fixture(params=[KEY], ids=["with-key"])
def page(browser, request):
    context, page = _page(browser, request.param)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"the page raised: {errors}"


@pytest.fixture
def keyless_page(browser):
    context, page = _page(browser, None)
    yield page
    context.close()


def _int(page, selector: str) -> int:
    return int(page.locator(selector).inner_text())


# The texts the newest answer showed, one per DOM change: more than one means it streamed.
WATCH_ANSWER = """() => {
  window.__seen = [];
  new MutationObserver(() => {
    const all = document.querySelectorAll('.msg.assistant .text');
    const text = all.length ? all[all.length - 1].textContent : '';
    if (text && window.__seen[window.__seen.length - 1] !== text) window.__seen.push(text);
  }).observe(document.getElementById('messages'),
             {subtree: true, childList: true, characterData: true});
}"""

ANSWER_DONE = """() => {
  const stats = document.querySelectorAll('.msg.assistant .stats');
  return stats.length && /finish: /.test(stats[stats.length - 1].textContent)
    && !document.querySelector('.msg.streaming') && !document.querySelector('.msg.error');
}"""


def test_a_typed_message_streams_an_answer_kept_in_the_browser(server, page):
    assert f"chat and live engine view: {server.url}/" in server.log()  # the start-up line
    page.goto(f"{server.url}/")
    sync_api.expect(page.locator("#model-name")).to_contain_text("SmolLM2-135M-Instruct")
    page.click("#settings summary")
    page.fill("#system", "You are a helpful assistant.")
    page.fill("#max_tokens", "16")
    page.fill("#seed", "7")
    page.evaluate(WATCH_ANSWER)
    page.fill("#input", "Write one sentence about the sea.")
    page.press("#input", "Enter")
    sync_api.expect(page.locator(".msg.user")).to_have_text("Write one sentence about the sea.")
    page.wait_for_function(ANSWER_DONE, timeout=WAIT_MS)
    answer = page.locator(".msg.assistant .text").inner_text()
    stats = page.locator(".msg.assistant .stats").inner_text()
    seen = page.evaluate("window.__seen")
    assert answer.strip(), "empty answer"
    assert len(seen) > 1 and seen[-1] == answer, f"the answer did not stream: {seen}"
    assert all(answer.startswith(partial) for partial in seen)
    tokens = int(stats.split(" tokens")[0])
    assert 1 <= tokens <= 16 and "tok/s" in stats and "first token" in stats
    # the conversation stays in the browser; regenerate replaces the answer
    page.reload()
    sync_api.expect(page.locator(".msg.assistant .text")).to_have_text(answer)
    page.click("#regenerate")
    page.wait_for_function(ANSWER_DONE, timeout=WAIT_MS)
    assert page.locator(".msg.user").count() == 1 and page.locator(".msg.assistant").count() == 1


class LongRequest:
    """A streamed completion that runs until `stop()` closes it (the server then aborts it)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.request_id: str | None = None
        self.started = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {
            "prompt": "List the planets of the solar system and describe each one. " * 4,
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            url, auth = f"{self.url}/v1/completions", {"Authorization": f"Bearer {KEY}"}
            with httpx.stream("POST", url, json=body, headers=auth, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.request_id = self.request_id or json.loads(line[6:])["id"]
                        self.started.set()
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # surfaced by the test
            self.error = exc
            self.started.set()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(60)


def test_the_kv_map_and_running_list_follow_a_long_request(server, page):
    page.goto(f"{server.url}/")
    sync_api.expect(page.locator("#kv-geometry")).to_contain_text("128 blocks", timeout=WAIT_MS)
    sync_api.expect(page.locator("#kv-held")).to_have_text("0")
    long = LongRequest(server.url)
    try:
        assert long.started.wait(WAIT_MS / 1000) and long.error is None, long.error
        row = page.locator(f'#running li[data-request-id="{long.request_id}"]')
        sync_api.expect(row).to_be_visible(timeout=WAIT_MS)
        sync_api.expect(row).to_contain_text("blocks")
        held = _int(page, "#kv-held") + _int(page, "#kv-shared")
        assert held >= 4  # a 50-token prompt and its output: at least 4 blocks of 16
        assert _int(page, "#t-running") == 1
        # the canvas paints the request's blocks in its colour: some pixel is not grey
        painted = page.evaluate("""() => {
          const c = document.getElementById('kv-map');
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          for (let i = 0; i < d.length; i += 4) {
            const [r, g, b] = [d[i], d[i + 1], d[i + 2]];
            if (Math.max(r, g, b) - Math.min(r, g, b) > 60) return true;
          }
          return false;
        }""")
        assert painted
    finally:
        long.stop()
    sync_api.expect(page.locator("#running li.empty")).to_be_visible(timeout=WAIT_MS)
    sync_api.expect(page.locator("#kv-held")).to_have_text("0", timeout=WAIT_MS)
    assert _int(page, "#kv-shared") == 0
    free, cached = _int(page, "#kv-free"), _int(page, "#kv-cached")
    assert free + cached == 127 and cached >= 3  # its full blocks stay in the prefix cache


def test_with_an_api_key_the_page_asks_for_it(server, keyless_page):
    url, page = server.url, keyless_page
    assert httpx.get(f"{url}/v1/engine/snapshot", timeout=30).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/v1/engine/snapshot", headers=auth, timeout=30).status_code == 200
    page.goto(f"{url}/")
    dialog = page.locator("#key-dialog")
    sync_api.expect(dialog).to_be_visible()
    sync_api.expect(page.locator("#key-error")).to_be_hidden()
    page.fill("#key-input", "wrong")
    page.click("#key-save")
    sync_api.expect(page.locator("#key-error")).to_be_visible()
    page.fill("#key-input", KEY)
    page.click("#key-save")
    sync_api.expect(dialog).to_be_hidden()
    sync_api.expect(page.locator("#model-name")).to_contain_text("SmolLM2-135M-Instruct")
    sync_api.expect(page.locator("#kv-geometry")).to_contain_text("128 blocks", timeout=WAIT_MS)
    page.fill("#input", "Hi")
    page.click("#settings summary")
    page.fill("#max_tokens", "4")
    page.press("#input", "Enter")
    page.wait_for_function(ANSWER_DONE, timeout=WAIT_MS)
