"""The web chat page in a real browser: Debian's headless chromium, driven by Selenium.

`make test` installs chromium + chromedriver with apt-get (as root); without them this test skips
and says so. No browser or driver is ever downloaded (Selenium Manager is bypassed by giving the
driver's path).
"""

from __future__ import annotations

import shutil
import time

import pytest

from serve_helpers import chat_generator, server  # noqa: F401 (fixtures)

webdriver = pytest.importorskip("selenium.webdriver")


def _browser_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("chromium and chromedriver are not installed: `apt-get install -y chromium chromium-driver` "
                    "(make test does it when run as root)")
    return browser, driver


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting for the page")


@pytest.fixture
def browser(tmp_path):
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary, driver = _browser_paths()
    options = Options()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1000,700", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    session = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    yield session
    session.quit()


def test_chat_page_streams_an_answer_keeps_the_conversation_and_stops(server, chat_generator, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(server.base + "/")
    wait_for(lambda: browser.find_element(By.ID, "model").text)  # the page read /v1/models
    for field, value in (("temperature", "0"), ("max-tokens", "12")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    question = "What is the capital of France?"
    browser.find_element(By.ID, "input").send_keys(question)
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]"))
    answer = browser.execute_script(
        "return document.querySelector('.message.assistant .content').textContent")
    conversation = [{"role": "user", "content": question}]
    assert answer == chat_generator.generate(conversation, max_new_tokens=12)
    assert "tokens/s" in browser.find_element(By.ID, "stats").text
    browser.save_screenshot(str(tmp_path / "chat.png"))

    # Turn 2 carries turn 1: the page keeps the conversation.
    browser.find_element(By.ID, "input").send_keys("And Germany?")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]")) == 2)
    second = browser.execute_script(
        "return document.querySelectorAll('.message.assistant .content')[1].textContent")
    conversation += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And Germany?"}]
    assert second == chat_generator.generate(conversation, max_new_tokens=12)

    # Stop: a long reply (in a new chat) is aborted in the browser and its sequence cancelled on the server.
    browser.find_element(By.ID, "clear").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".message")
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("200")
    generated = server.service.metrics.generated_tokens._value.get()
    browser.find_element(By.ID, "input").send_keys("Tell me a long story")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: browser.execute_script("return document.body.dataset.state") == "streaming")
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]"))
    assert "stopped" in browser.find_element(By.ID, "stats").text
    wait_for(lambda: server.service.active_sequences() == 0, timeout=10)
    assert server.service.metrics.generated_tokens._value.get() - generated < 200  # cancelled, not finished
    browser.save_screenshot(str(tmp_path / "chat-stopped.png"))
    print(f"screenshots: {tmp_path / 'chat.png'}, {tmp_path / 'chat-stopped.png'}")
