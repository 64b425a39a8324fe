"""The viewer in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`) driven by selenium
against a real `--store-only` gateway with a bearer token, over real trajectories and SIS records posted over
HTTP. The page asks for the token, loads without console errors, draws the run's charts, lists the tokens SIS
accepts and rejects most, filters the trajectory list, and renders one trajectory with exactly the policy /
inserted / accepted / rejected / outside tokens of the store (read back from the DOM). Screenshots go to
test-artifacts/ (the path is printed)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.services.viewer_data import RUN, sis_record

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (`pip install -e '.[dev]'`)")
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

# An element the page re-renders between finding it and reading it: the wait looks again
RERENDERED = (NoSuchElementException, StaleElementReferenceException)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
WAIT_S = 30

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no headless Chromium: install Debian's `chromium` and `chromium-driver` (`make browser` does, as root)")


@pytest.fixture(scope="module")
def records(store_only_gateway: Any, viewer_store: Any) -> dict[str, dict[str, Any]]:
    """One SIS record per trajectory, posted over HTTP as the trainer does."""
    recs = [sis_record(t, seed=i) for i, t in enumerate(viewer_store.trajectories)]
    store_only_gateway.client.post("/v1/sis_records", json={"run": RUN, "step": 1, "records": recs}).raise_for_status()
    return {r["trajectory_id"]: r for r in recs}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1100",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


def _ready(driver: Any, view: str) -> None:
    WebDriverWait(driver, WAIT_S).until(
        lambda d: d.execute_script("return [document.body.dataset.view, document.body.dataset.ready]") == [view, "1"])


def _count(driver: Any, css: str) -> int:
    return int(driver.execute_script("return document.querySelectorAll(arguments[0]).length", css))


def _screenshot(driver: Any, name: str) -> Path:
    """The whole page (the window grows to the document's height for the shot), as test-artifacts/NAME."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    size = driver.get_window_size()
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(size["width"], min(max(height + 140, size["height"]), 4000))
    driver.save_screenshot(str(path))
    driver.set_window_size(size["width"], size["height"])
    print(f"viewer screenshot: {path}")
    return path


def _check_versions(driver: Any, traj: dict[str, Any]) -> None:
    """Tokens sampled by a newer version than the trajectory's first are marked; the facts give the span."""
    versions = traj["token_versions"]
    newer = [t for t, v in enumerate(versions) if v > traj["policy_version"]]
    assert _count(driver, "#tokens .tok.policy.newer") == len(newer)
    shown_versions = driver.find_element(By.ID, "versions").text
    if newer:
        assert shown_versions.startswith(f"{traj['policy_version']} → {max(versions)}"), shown_versions
        assert f"newer from token {newer[0]}" in shown_versions
    else:
        assert shown_versions == str(traj["policy_version"])


def test_viewer_in_chromium(browser: Any, store_only_gateway: Any, viewer_store: Any,
                            records: dict[str, dict[str, Any]]) -> None:
    trajectories = viewer_store.trajectories
    browser.get(f"{store_only_gateway.url}/ui")
    _ready(browser, "token")  # /health says a token is required: the page asks before any data request
    browser.find_element(By.ID, "token-input").send_keys(store_only_gateway.token)
    browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    _ready(browser, "runs")
    assert browser.execute_script("return sessionStorage.getItem('sisrl.gateway.token')") == store_only_gateway.token
    browser.find_element(By.LINK_TEXT, RUN).click()

    _ready(browser, "run")
    points = browser.execute_script("return [...document.querySelectorAll('canvas')].map(c => c.dataset.points)")
    # reward, EM (nq + hotpotqa), accept rate + outside, D + D_SIS, searches: 2 steps each; SIS posted at step 1
    assert points == ["2", "4", "2", "2", "2"]
    assert _count(browser, "#most-accepted li") > 0 and _count(browser, "#most-rejected li") > 0
    assert _count(browser, "#traj-rows tr") == len(trajectories)
    Select(browser.find_element(By.ID, "f-searched")).select_by_value("false")
    WebDriverWait(browser, WAIT_S, ignored_exceptions=RERENDERED).until(lambda d: d.find_element(By.ID, "main").get_attribute("data-list-generation") == "2")
    unsearched = [t for t in trajectories if not t["turns"]]
    assert 0 < _count(browser, "#traj-rows tr") == len(unsearched) < len(trajectories)
    Select(browser.find_element(By.ID, "f-searched")).select_by_value("true")
    Select(browser.find_element(By.ID, "f-sort")).select_by_value("-length")
    WebDriverWait(browser, WAIT_S, ignored_exceptions=RERENDERED).until(lambda d: d.find_element(By.ID, "main").get_attribute("data-list-generation") == "4")
    lengths = browser.execute_script(
        "return [...document.querySelectorAll('#traj-rows tr td:nth-child(7)')].map(td => Number(td.textContent))")
    assert lengths == sorted((len(t["response_ids"]) for t in trajectories if t["turns"]), reverse=True)
    _screenshot(browser, "viewer-run.png")

    longest = browser.find_element(By.CSS_SELECTOR, "#traj-rows tr").get_attribute("data-id")
    browser.find_element(By.CSS_SELECTOR, "#traj-rows tr a").click()
    _ready(browser, "trajectory")
    traj = next(t for t in trajectories if t["id"] == longest)
    status = records[longest]["status"]
    mask = traj["loss_mask"]
    assert _count(browser, "#tokens .tok") == len(traj["response_ids"])
    assert _count(browser, "#tokens .tok.policy") == sum(mask)
    assert _count(browser, "#tokens .tok.inserted") == len(mask) - sum(mask) > 0
    for css, code in (("acc", 1), ("rej", 0), ("out", 2)):
        assert _count(browser, f"#tokens .tok.policy.{css}") == status.count(code), css
    text = browser.find_element(By.ID, "tokens").text
    assert "<information>Doc 1(Title:" in text and "<answer>" in text
    assert _count(browser, "#searches tbody tr") == len(traj["turns"])
    assert "Question:" in browser.find_element(By.ID, "prompt").text

    _check_versions(browser, traj)
    first = mask.index(1)
    browser.find_element(By.CSS_SELECTOR, f'#tokens .tok[data-t="{first}"]').click()  # pins the detail panel
    panel = browser.find_element(By.ID, "token-detail").text
    assert f"{traj['response_ids'][first]}" in panel and "rank in q's top-K" in panel and "1 of 5" in panel
    assert "ratio used" in panel and "log π" in panel and f"policy version\n{traj['token_versions'][first]}" in panel
    _screenshot(browser, "viewer-trajectory.png")

    # a trajectory a weight load landed in (tests/services/viewer_data.py): its later turns are the newer version's
    spanning = next(t for t in trajectories if len({v for v in t["token_versions"] if v >= 0}) == 2)
    browser.get(f"{store_only_gateway.url}/ui#/trajectory/{spanning['id']}")
    WebDriverWait(browser, WAIT_S, ignored_exceptions=RERENDERED).until(lambda d: spanning["id"] in d.find_element(By.TAG_NAME, "h1").text)
    _ready(browser, "trajectory")
    _check_versions(browser, spanning)

    assert store_only_gateway.token not in browser.current_url
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
