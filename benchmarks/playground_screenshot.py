"""A screenshot of the playground page of a running ``verispec serve``, after a comparison run.

    .venv/bin/python benchmarks/playground_screenshot.py --url http://127.0.0.1:8000 --out docs/playground.png \
        [--key KEY] [--prompt TEXT] [--mode chat|completion] [--max-tokens N] [--draft server|auto|fixed|off]

Headless Chromium from Debian's packages (``apt-get install chromium chromium-driver``) driven by Selenium with
the system chromedriver: nothing is downloaded. The page streams the prompt with speculation ("Compare with target
alone" also runs it with the draft off), then the window is saved as PNG. Exits non-zero, saying why, if the page
shows an error (a wrong key, a refused request) or does not finish within ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def chromium(width: int = 1280, height: int = 900):
    """Headless Chromium through the system chromedriver, with the browser's console kept (``get_log``)."""
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not look for (or fetch) a browser
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--disable-extensions", "--no-first-run", "--disable-background-networking",
                     f"--window-size={width},{height}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def wait_for(driver, condition, timeout: float, what: str):
    """Poll ``condition(driver)`` (the page changes as the stream arrives) until it returns something true."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition(driver)
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout} s")
        time.sleep(0.05)


def state(driver) -> str:
    return driver.execute_script("return document.body.dataset.state || ''")


def run_page(driver, url: str, key: str | None, prompt: str, *, mode: str = "completion", max_tokens: int = 64,
             draft: str = "server", draft_length: int = 4, temperature: float = 0.0, compare: bool = True,
             timeout: float = 120.0) -> None:
    """Open the page, give the key, fill the form and run (compare or generate) until the page is done."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(url.rstrip("/") + "/playground")
    wait_for(driver, lambda d: d.execute_script("return document.body.dataset.auth || ''"), timeout, "connected")
    if key is not None:
        field = driver.find_element(By.ID, "api-key")
        field.clear()
        field.send_keys(key)
        driver.execute_script("delete document.body.dataset.auth")  # set again once the key is checked
        driver.find_element(By.ID, "key-save").click()
        auth = wait_for(driver, lambda d: d.execute_script("return document.body.dataset.auth || ''"), timeout,
                        "the key checked")
        if auth != "ok":
            raise RuntimeError("the key was not accepted: " + driver.find_element(By.ID, "auth-message").text)
    driver.find_element(By.CSS_SELECTOR, f'input[name="mode"][value="{mode}"]').click()
    for element_id, value in (("prompt", prompt), ("max-tokens", str(max_tokens)), ("temperature", str(temperature))):
        field = driver.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)
    Select(driver.find_element(By.ID, "draft")).select_by_value(draft)
    if draft == "fixed":
        field = driver.find_element(By.ID, "draft-length")
        field.clear()
        field.send_keys(str(draft_length))
    driver.find_element(By.ID, "compare" if compare else "generate").click()
    ready = (lambda d: not d.find_element(By.ID, "compare-panel").get_attribute("hidden")) if compare else \
        (lambda d: True)
    final = wait_for(driver, lambda d: state(d) in ("done", "error") and (state(d) == "error" or ready(d))
                     and state(d), timeout, "the run finished")
    if final == "error":
        raise RuntimeError("the page reports: " + driver.find_element(By.ID, "status").text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--key", default=os.environ.get("VERISPEC_API_KEY"),
                        help="API key (default: $VERISPEC_API_KEY)")
    parser.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    parser.add_argument("--mode", choices=["chat", "completion"], default="chat")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft", choices=["server", "auto", "fixed", "off"], default="server")
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--no-compare", dest="compare", action="store_false", help="generate only")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    driver = chromium(args.width, args.height)
    try:
        run_page(driver, args.url, args.key, args.prompt, mode=args.mode, max_tokens=args.max_tokens,
                 draft=args.draft, draft_length=args.draft_length, compare=args.compare, timeout=args.timeout)
        driver.save_screenshot(args.out)
    except (RuntimeError, TimeoutError) as error:
        print(f"playground_screenshot: {error}", file=sys.stderr)
        return 1
    finally:
        driver.quit()
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
