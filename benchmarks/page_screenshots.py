"""Remake docs/page-idle.png and docs/page-load.png: a server with a small KV pool and a
small batch (so the queue and the pool show their states), one chat answer, then a burst of
completions with shared prefixes, caught mid-run.

    python benchmarks/page_screenshots.py [--out docs]
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path

import httpx
from page_overhead import start_server

SERVER_ARGS = ["--num-blocks", "160", "--max-num-seqs", "6", "--max-model-len", "1024"]


def burst(url: str, n: int) -> threading.Thread:
    def one(i: int) -> None:
        prefix = "You are a careful assistant. Summarise the history of astronomy. " * (1 + i % 3)
        body = {"prompt": prefix + f"Part {i}:", "max_tokens": 160 + 40 * i, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    joiner = threading.Thread(target=lambda: [t.join() for t in threads], daemon=True)
    joiner.start()
    return joiner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="docs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    from playwright.sync_api import sync_playwright

    proc, url = start_server(SERVER_ARGS)
    try:
        with sync_playwright() as p:
            chromium = shutil.which("chromium") or "/usr/bin/chromium"
            browser = p.chromium.launch(
                executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 860})
            page.goto(f"{url}/")
            page.fill("#input", "What is the capital of France? Answer in one sentence.")
            page.press("#input", "Enter")
            page.wait_for_function(
                "/finish: /.test(document.querySelector('.msg.assistant .stats').textContent)",
                timeout=300_000,
            )
            time.sleep(2)
            page.screenshot(path=str(out / "page-idle.png"))
            page.fill("#input", "Name three planets and one fact about each.")
            page.press("#input", "Enter")
            joiner = burst(url, 12)
            time.sleep(10)
            page.screenshot(path=str(out / "page-load.png"))
            joiner.join(600)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
