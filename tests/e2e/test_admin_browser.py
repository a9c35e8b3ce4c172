"""The admin page in a real headless browser, against ``pgbroker serve`` and a real worker.

Debian's ``chromium`` driven by Playwright (no browser download: ``executable_path`` points at
/usr/bin/chromium; install it with ``apt-get install chromium``). The test logs in, sees a dead job
(a real failure, with its traceback) and a poison job, retries a dead job and watches the worker
run it while the overview updates itself, pauses and resumes a queue, checks the audit rows, and
saves the screenshot used by the docs (docs/admin.png).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.e2e import app as e2e
from tests.e2e.support import (  # noqa: F401, F811 - fixtures
    job,
    key_runs,
    producer,
    runs,
    start_worker,
)
from tests.helpers import REPO_ROOT, wait_for
from tests.integration.test_cli import pgbroker_process
from tests.integration.test_metrics import LOST, add_job

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = REPO_ROOT / "docs" / "admin.png"
USER, PASSWORD = "alice", "correct horse battery"

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Debian's chromium is not installed (apt-get install chromium)")


@pytest.fixture
def admin_url(db_url: str, tmp_path: Path) -> Iterator[str]:
    """``pgbroker serve`` on a free loopback port; its base URL."""
    log = tmp_path / "serve.log"
    env = {**os.environ, "PGBROKER_ADMIN_USER": USER, "PGBROKER_ADMIN_PASSWORD": PASSWORD,
           "PYTHONUNBUFFERED": "1"}
    env.pop("PGBROKER_ADMIN_TOKEN", None)
    with pgbroker_process("--database-url", db_url, "serve", "--port", "0", "--refresh", "1",
                          log=log, env=env) as proc:
        def serving() -> str | None:
            assert proc.poll() is None, f"pgbroker serve exited:\n{log.read_text()}"
            match = re.search(r"serving on (http://\S+)/", log.read_text())
            return match[1] if match else None

        yield wait_for(serving, 60, interval=0.1, message="pgbroker serve to listen")


@pytest.fixture
def page() -> Iterator[object]:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1500, "height": 900})
            page = context.new_page()
            page.set_default_timeout(30_000)
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.dialogs = dialogs  # type: ignore[attr-defined] - read by the test
            yield page
        finally:
            browser.close()


def test_operator_session_in_a_browser(producer, runs: psycopg.Connection, admin_url: str,
                                       page) -> None:
    expect = sync_api.expect
    # A real failure (a task that raises) and a job whose first attempt failed, before any worker.
    failed = e2e.boom.apply_async(args=["browser-boom"])
    second = e2e.touch.apply_async(args=["browser-retry"])
    wait_for(lambda: job(runs, second.id), 30, message="the job row")
    runs.execute("UPDATE pgbroker.jobs SET state = 'dead', attempts = 1, failed_attempt = 1,"
                 " last_error = 'ConnectionError: the SMTP server hung up',"
                 " last_traceback = 'Traceback (most recent call last):\n  File \"mail.py\"'"
                 " WHERE task_id = %s", (second.id,))
    # A poison job that carries markup in its payload and task name.
    poison_id = add_job(runs, "dead", queue="celery", task="<script>alert('task')</script>",
                        last_error=LOST, attempts=3, max_attempts=3,
                        body=b'[["<script>alert(\'body\')</script>"], {}, {}]',
                        content_type="application/json")
    worker = start_worker(producer.conf.broker_url)
    wait_for(lambda: job(runs, failed.id)["state"] == "dead", 60, message="boom to go dead")

    # Log in (the overview needs it).
    page.goto(admin_url + "/")
    expect(page).to_have_url(re.compile(r"/login\?next="))
    page.fill("input[name=user]", USER)
    page.fill("input[name=password]", PASSWORD)
    page.click("form.login button")
    celery_row = page.locator('tr[data-queue="celery"]')
    expect(celery_row.locator('[data-col="dead"]')).to_have_text("3")
    expect(celery_row.locator('[data-col="poison"]')).to_have_text("1")

    # Dead letters: the real error with its traceback, the poison job marked.
    page.click("text=Dead letters")
    boom_row = page.locator(f'tr[data-job="{job(runs, failed.id)["id"]}"]')
    expect(boom_row).to_contain_text("ValueError: boom browser-boom")
    boom_row.locator("summary").click()
    expect(boom_row.locator("pre")).to_contain_text("Traceback (most recent call last)")
    poison_row = page.locator(f'tr[data-job="{poison_id}"]')
    expect(poison_row).to_have_class("poison")
    expect(poison_row).to_contain_text("poison: killed its worker on every attempt")
    expect(poison_row).to_contain_text("<script>alert('task')</script>")  # shown as text

    # Retry the job whose attempt failed: the worker runs it and the overview follows live.
    page.locator(f'tr[data-job="{job(runs, second.id)["id"]}"] button.retry').click()
    expect(page.locator(".flash.ok")).to_contain_text("it is pending again")
    wait_for(lambda: key_runs(runs, "browser-retry"), 60, message="the worker to run it")
    page.click("text=Queues")
    expect(celery_row.locator('[data-col="completed"]')).to_have_text("1")
    expect(celery_row.locator('[data-col="dead"]')).to_have_text("2")

    # Pause: a job sent now waits -- and the page, not reloaded, shows it (htmx polling);
    # resume: it runs.
    celery_row.locator("button.pause").click()
    expect(celery_row.locator(".paused-badge")).to_be_visible()
    page.click("details.by-task summary")
    with page.expect_request(lambda r: r.url.endswith("/overview/live")):
        held = e2e.touch.apply_async(args=["browser-held"])
    expect(celery_row.locator('[data-col="pending"]')).to_have_text("1")
    expect(page.locator("details.by-task")).to_have_attribute("open", "")  # kept across updates
    expect(celery_row.locator('[data-col="consumers"]')).to_have_text("1")  # its heartbeat came
    assert job(runs, held.id)["state"] == "pending"
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    celery_row.locator("button.resume").click()
    expect(celery_row.locator(".active-badge")).to_be_visible()
    wait_for(lambda: key_runs(runs, "browser-held"), 60, message="the held job after resume")

    # The poison job's page shows its payload as text; no script ever ran.
    page.goto(f"{admin_url}/jobs/{poison_id}")
    expect(page.locator("pre.body")).to_contain_text("<script>alert('body')</script>")
    assert page.dialogs == []

    audit = runs.execute("SELECT actor, action, target, detail ->> 'via' FROM pgbroker.audit"
                         " ORDER BY id").fetchall()
    assert audit == [(USER, "dead.retry", str(job(runs, second.id)["id"]), "admin"),
                     (USER, "queue.pause", "celery", "admin"),
                     (USER, "queue.resume", "celery", "admin")]
    worker.stop()
