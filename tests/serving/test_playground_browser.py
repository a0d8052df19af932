"""The playground page in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by Selenium
through the system chromedriver; nothing is downloaded), against a server with the tiny models on loopback.

Run with ``pytest -m browser`` (kept out of the default run: a browser start costs seconds). Screenshots are
written under pytest's tmp dir, and also to ``$VERISPEC_ARTIFACTS`` when that is set (CI keeps them).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from serving_support import MODEL, serve_tiny

from verispec.serving.config import ServerOptions

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
KEY = "playground-test-key"
PROMPT = "def x ( y ) : return"
KINDS = {"accepted", "recovered", "bonus", "plain"}


def _screenshot_module():
    script = ROOT / "benchmarks" / "playground_screenshot.py"
    spec = importlib.util.spec_from_file_location("playground_screenshot", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


page = _screenshot_module()


@pytest.fixture(scope="module")
def keyed(model_dirs):
    """A server with an API key and a fixed draft length (3)."""
    server = serve_tiny(model_dirs, options=ServerOptions(api_keys=(KEY,)), num_draft_tokens=3)
    yield server
    server.close()
    server.engine.shutdown()


@pytest.fixture
def browser():
    driver = page.chromium(1280, 1000)
    yield driver
    driver.quit()


def keep(path: Path) -> Path:
    """A screenshot: kept in ``$VERISPEC_ARTIFACTS`` as well, when set."""
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    folder = os.environ.get("VERISPEC_ARTIFACTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(folder) / path.name)
    return path


def console_errors(driver, allowed: tuple[str, ...] = ()) -> list[str]:
    """The browser console's errors (SEVERE), less those that contain one of ``allowed``."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" and not any(text in entry["message"] for text in allowed)]


def tokens(driver) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#output .tok')].map(s => ({kind: s.classList[1], text: s.textContent,"
        " step: Number(s.dataset.step), title: s.title}))")


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def test_a_prompt_streams_with_marked_tokens_and_compare_finds_identical_greedy_text(keyed, browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    page.run_page(browser, keyed.url, KEY, PROMPT, mode="completion", max_tokens=40, draft="fixed", draft_length=3)
    assert text_of(browser, "model-name") == MODEL
    marked = tokens(browser)
    assert marked and {t["kind"] for t in marked} <= KINDS
    assert "accepted" in {t["kind"] for t in marked}  # the perturbed draft is kept often on the tiny pair
    assert all("target pass" in t["title"] and "logprob" in t["title"] for t in marked)  # what hovering shows
    assert text_of(browser, "stat-tokens") == str(len(marked))
    assert text_of(browser, "stat-passes") == str(len({t["step"] for t in marked}))
    assert float(text_of(browser, "stat-per-pass")) > 1.0
    assert browser.find_elements(By.CSS_SELECTOR, "#positions progress")  # acceptance by draft position
    verdict = browser.find_element(By.ID, "cmp-identical")
    assert verdict.get_attribute("data-identical") == "true", verdict.text
    assert "".join(t["text"] for t in marked) == text_of(browser, "cmp-base-text")
    for element_id in ("cmp-spec-speed", "cmp-base-speed"):
        assert float(text_of(browser, element_id)) > 0
    # Keyboard: the output takes focus and the arrow keys walk the tokens, each described in a live region.
    output = browser.find_element(By.ID, "output")
    output.send_keys(Keys.ARROW_RIGHT)
    output.send_keys(Keys.ARROW_RIGHT)
    assert text_of(browser, "token-info").startswith("Token 2 ")
    assert browser.switch_to.active_element == output
    assert browser.save_screenshot(str(tmp_path / "playground.png"))
    keep(tmp_path / "playground.png")
    assert console_errors(browser) == []


def test_chat_streams_too(keyed, browser) -> None:
    page.run_page(browser, keyed.url, KEY, "hello world", mode="chat", max_tokens=20, compare=False)
    assert {t["kind"] for t in tokens(browser)} <= KINDS and tokens(browser)
    assert console_errors(browser) == []


def test_a_missing_or_wrong_key_shows_a_clear_message(keyed, browser) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{keyed.url}/")  # redirected to the page
    assert browser.current_url.endswith("/playground")
    page.wait_for(browser, lambda d: d.execute_script("return document.body.dataset.auth"), 30, "the key checked")
    message = browser.find_element(By.ID, "auth-message")
    assert message.is_displayed() and "needs an API key" in message.text
    browser.find_element(By.ID, "generate").click()
    page.wait_for(browser, lambda d: page.state(d) == "error", 30, "the refused request")
    assert "Not authorised" in text_of(browser, "status")
    assert console_errors(browser) == []  # no request was sent that had to fail

    field = browser.find_element(By.ID, "api-key")
    field.send_keys("not-the-key")
    browser.find_element(By.ID, "key-save").click()
    page.wait_for(browser, lambda d: "not accepted" in d.find_element(By.ID, "auth-message").text, 30, "refusal")
    # The only console errors: Chromium's lines for the 401 responses themselves.
    assert console_errors(browser, allowed=("401",)) == []


CONTRAST = """
const rgb = (text) => (text.match(/[\\d.]+/g) || []).map(Number);
const linear = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
const luminance = ([r, g, b]) => [r, g, b].map(linear)
  .reduce((sum, c, i) => sum + c * [0.2126, 0.7152, 0.0722][i], 0);
const background = (element) => {
  for (let e = element; e; e = e.parentElement) {
    const color = rgb(getComputedStyle(e).backgroundColor);
    if (color.length === 3 || (color.length === 4 && color[3] > 0)) return color.slice(0, 3);
  }
  return [255, 255, 255];
};
return [...document.querySelectorAll('.tok, button:not(:disabled), label, .status, #token-info')].map((e) => {
  const [a, b] = [luminance(rgb(getComputedStyle(e).color).slice(0, 3)), luminance(background(e))];
  return [e.className || e.id || e.tagName, (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)];
});
"""


def test_readable_on_a_phone_and_every_control_labelled(keyed, browser, tmp_path) -> None:
    browser.set_window_size(390, 844)
    page.run_page(browser, keyed.url, KEY, PROMPT, mode="completion", max_tokens=30, compare=False)
    widths = browser.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths  # no sideways scrolling
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input, select, textarea, button')]"
        ".filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim())"
        ".map(e => e.id || e.name)")
    assert unlabelled == []
    # WCAG contrast of every marked token, the legend and the buttons against what is behind them (page white
    # where their own background is transparent): at least 4.5:1, the AA level for body text.
    ratios = browser.execute_script(CONTRAST)
    assert ratios and all(ratio >= 4.5 for _, ratio in ratios), ratios
    assert browser.save_screenshot(str(tmp_path / "playground-phone.png"))
    keep(tmp_path / "playground-phone.png")
    assert console_errors(browser) == []


def test_the_screenshot_script_against_a_running_server(keyed, tmp_path) -> None:
    out = tmp_path / "playground-script.png"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "playground_screenshot.py"), "--url", keyed.url,
                           "--key", KEY, "--out", str(out), "--mode", "completion", "--prompt", PROMPT,
                           "--max-tokens", "24", "--timeout", "120"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    keep(out)
    wrong = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "playground_screenshot.py"), "--url", keyed.url,
                            "--key", "wrong", "--out", str(tmp_path / "never.png"), "--timeout", "20"],
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 1 and "not accepted" in wrong.stderr
