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
    answer = browser.execute_script("return document.querySelector('.message.assistant').raw")  # the text as sent
    conversation = [{"role": "user", "content": question}]
    assert answer == chat_generator.generate(conversation, max_new_tokens=12)
    assert "tokens/s" in browser.find_element(By.ID, "stats").text
    browser.save_screenshot(str(tmp_path / "chat.png"))

    # Turn 2 carries turn 1: the page keeps the conversation.
    browser.find_element(By.ID, "input").send_keys("And Germany?")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]")) == 2)
    second = browser.execute_script("return document.querySelectorAll('.message.assistant')[1].raw")
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
    # Stop as soon as the reply streams, from inside the page: an observer of the page's state clicks Stop when
    # it turns to streaming (a tiny model's 200 tokens take ~0.3 s, which polling every 0.1 s from here missed)
    browser.execute_script(
        "new MutationObserver((changes, observer) => {"
        "  if (document.body.dataset.state !== 'streaming') return;"
        "  observer.disconnect(); document.getElementById('stop').click();"
        "}).observe(document.body, {attributes: true, attributeFilter: ['data-state']});")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]"))
    assert "stopped" in browser.find_element(By.ID, "stats").text
    wait_for(lambda: server.service.active_sequences() == 0, timeout=10)
    assert server.service.metrics.generated_tokens._value.get() - generated < 200  # cancelled, not finished
    browser.save_screenshot(str(tmp_path / "chat-stopped.png"))
    print(f"screenshots: {tmp_path / 'chat.png'}, {tmp_path / 'chat-stopped.png'}")


FENCED = "Here is the function:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nIt **adds**. <img src=x onerror=alert(1)>"


def test_chat_page_renders_markdown_keeps_chats_and_uses_the_system_prompt(server, chat_generator, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(server.base + "/")
    wait_for(lambda: browser.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "system").send_keys("You are terse.")
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("10")
    temperature = browser.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("0")
    browser.find_element(By.ID, "input").send_keys("Hello there")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]"))
    answer = browser.execute_script("return document.querySelector('.message.assistant').raw")
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    assert answer == chat_generator.generate(conversation, max_new_tokens=10)  # the system prompt was sent

    # A reload finds the conversation (localStorage) and lists it among the chats.
    browser.refresh()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]"))
    assert browser.execute_script("return document.querySelector('.message.assistant').raw") == answer
    assert browser.find_element(By.ID, "system").get_attribute("value") == "You are terse."
    assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#history button")] == ["Hello there"]

    # A stored reply with a code fence renders as <pre><code> (monospace, with a copy button), sanitized.
    browser.execute_script("""
        const store = JSON.parse(localStorage.getItem("fastdecode.chats"));
        store.chats["fenced"] = {title: "code", system: "", updated: Date.now(),
                                 messages: [{role: "user", content: "Write add"}, {role: "assistant", content: arguments[0]}]};
        store.current = "fenced";
        localStorage.setItem("fastdecode.chats", JSON.stringify(store));""", FENCED)
    browser.refresh()
    code = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant pre > code"))[0]
    assert code.text == "def add(a, b):\n    return a + b"
    assert "monospace" in code.value_of_css_property("font-family")
    assert browser.find_elements(By.CSS_SELECTOR, ".message.assistant pre > button.copy")
    assert browser.find_element(By.CSS_SELECTOR, ".message.assistant strong").text == "adds"
    assert not browser.find_elements(By.CSS_SELECTOR, ".message.assistant img[onerror]")  # DOMPurify
    assert len(browser.find_elements(By.CSS_SELECTOR, "#history button")) == 2
    browser.save_screenshot(str(tmp_path / "chat-markdown.png"))
    print(f"screenshot: {tmp_path / 'chat-markdown.png'}")
    # the older chat opens again from the list
    browser.find_elements(By.CSS_SELECTOR, "#history button")[1].click()
    assert browser.execute_script("return document.querySelector('.message.assistant').raw") == answer
