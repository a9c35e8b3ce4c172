"""The admin page in a real headless browser, against ``pgbroker serve``, a real worker and a
real beat.

Debian's ``chromium`` driven by Playwright (no browser download: ``executable_path`` points at
/usr/bin/chromium; install it with ``apt-get install chromium``). An operator logs in and uses
every page and action: the overview and its live charts, a dead letter retried and run, a queue
paused and resumed, the workers page showing what runs right now, a job's history across Celery's
retries, the jobs browser with a bulk retry (confirmed, with its count) and a bulk cancel, beat's
entries disabled and run now; a viewer sees the same pages without a single action, and a cookie
saved before a logout opens nothing after it. The test takes the screenshots the docs show
(docs/admin*.png): into the test's own directory, or into docs/ with PGBROKER_SCREENSHOTS=docs
(so that a test run never changes the checkout); an hour of history is inserted first, as the
transport leaves it, so that the charts have something to show.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgbroker.beat import Schedules
from tests.apps import e2e_app as e2e
from tests.support.workers import job, key_runs, start_worker
from tests.support.processes import REPO_ROOT, pgbroker_process, run_beat, wait_for
from tests.support.admin import fill_depth, fill_history
from tests.support.db import LOST, add_job

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
USER, PASSWORD = "alice", "correct horse battery"
VIEWER, VIEWER_PASSWORD = "victor", "look but don't touch"

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Debian's chromium is not installed (apt-get install chromium)")


@pytest.fixture
def admin_url(db_url: str, tmp_path: Path) -> Iterator[str]:
    """``pgbroker serve`` on a free loopback port; its base URL."""
    log = tmp_path / "serve.log"
    env = {**os.environ, "PGBROKER_ADMIN_USER": USER, "PGBROKER_ADMIN_PASSWORD": PASSWORD,
           "PGBROKER_ADMIN_VIEWER_USER": VIEWER, "PGBROKER_ADMIN_VIEWER_PASSWORD": VIEWER_PASSWORD,
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
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser, url: str, user: str, password: str):
    """A page of a new browser context, logged in; ``page.dialogs`` collects any alert()."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.dialogs = dialogs  # type: ignore[attr-defined] - read by the test
    page.goto(url + "/")
    sync_api.expect(page).to_have_url(re.compile(r"/login\?next="))
    page.fill("input[name=user]", user)
    page.fill("input[name=password]", password)
    page.click("form.login button")
    sync_api.expect(page.locator("h1")).to_have_text("Overview")
    return page


@pytest.fixture(autouse=True)
def _shots_dir(tmp_path: Path) -> Iterator[None]:
    global SHOTS
    SHOTS = REPO_ROOT / "docs" if os.environ.get("PGBROKER_SCREENSHOTS") == "docs" else tmp_path
    yield


SHOTS = Path()


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / name), full_page=True)


def test_operator_session_in_a_browser(producer, runs: psycopg.Connection, admin_url: str,
                                       browser, broker_url: str) -> None:
    expect = sync_api.expect
    fill_history(runs, 6000, 3600, queues=("celery", "mail"),
                 tasks=("tests.apps.e2e_app.touch", "tests.apps.e2e_app.add",
                        "tests.apps.e2e_app.nap"))
    fill_depth(runs, 60, "celery", "tests.apps.e2e_app.touch")
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
    flaky = e2e.flaky.apply_async(args=["browser-flaky", 2])  # fails twice, then succeeds
    Schedules(runs, actor="test", via="test").add(
        "hourly-touch", "tests.apps.e2e_app.touch", 3600.0, args=["beat-run-now"])
    beat = run_beat("tests.apps.beat_app", broker_url,
                    env={"PGBROKER_TEST_BEAT_OPTIONS": '{"queue": "beat", "overlap": "allow"}'})
    worker = start_worker(broker_url)
    wait_for(lambda: job(runs, failed.id)["state"] == "dead", 60, message="boom to go dead")
    wait_for(lambda: key_runs(runs, "browser-flaky") and len(key_runs(runs, "browser-flaky")) == 3,
             60, message="flaky to run three times")

    page = new_page(browser, admin_url, USER, PASSWORD)
    celery_row = page.locator('tr[data-queue="celery"]')
    expect(celery_row.locator('[data-col="dead"]')).to_have_text(re.compile(r"^\d+$"))
    dead_before = int(celery_row.locator('[data-col="dead"]').inner_text())
    assert dead_before >= 3  # boom, the failed attempt, the poison job (and the history's)
    expect(celery_row.locator('[data-col="poison"]')).to_have_text("1")
    expect(page.locator("svg.chart")).to_have_count(4)
    expect(page.locator(".charts-summary")).to_contain_text("finished")

    # Dead letters: the real error with its traceback, the poison job marked.
    page.click("header >> text=Dead letters")
    boom_row = page.locator(f'tr[data-job="{job(runs, failed.id)["id"]}"]')
    expect(boom_row).to_contain_text("ValueError: boom browser-boom")
    boom_row.locator("summary").click()
    expect(boom_row.locator("pre")).to_contain_text("Traceback (most recent call last)")
    poison_row = page.locator(f'tr[data-job="{poison_id}"]')
    expect(poison_row).to_have_class("poison")
    expect(poison_row).to_contain_text("<script>alert('task')</script>")  # shown as text

    # Retry the job whose attempt failed: the worker runs it and the overview follows live.
    page.locator(f'tr[data-job="{job(runs, second.id)["id"]}"] button.retry').click()
    expect(page.locator(".flash.ok")).to_contain_text("it is pending again")
    wait_for(lambda: key_runs(runs, "browser-retry"), 60, message="the worker to run it")

    # Pause: a job sent now waits -- and the page, not reloaded, shows it (htmx polling).
    page.click("header >> text=Overview")
    celery_row.locator("button.pause").click()
    expect(celery_row.locator(".paused-badge")).to_be_visible()
    expect(page.locator(".paused-box")).to_contain_text(f"queue celery by {USER}")
    page.click("details.by-task summary")
    with page.expect_request(lambda r: r.url.endswith("/overview/live")):
        held = e2e.touch.apply_async(args=["browser-held"])
    expect(celery_row.locator('[data-col="pending"]')).to_have_text("1")
    expect(page.locator("details.by-task")).to_have_attribute("open", "")  # kept across updates
    assert job(runs, held.id)["state"] == "pending"
    celery_row.locator("button.resume").click()
    expect(celery_row.locator(".active-badge")).to_be_visible()
    wait_for(lambda: key_runs(runs, "browser-held"), 60, message="the held job after resume")
    page.goto(admin_url + "/")
    with page.expect_request(lambda r: "/charts" in r.url):  # the charts follow live too
        pass
    shot(page, "admin.png")

    # Workers: the worker, its heartbeat, and the task it runs right now, since when.
    napping = e2e.nap.apply_async(args=["browser-nap", 6])
    wait_for(lambda: job(runs, napping.id)["state"] == "running", 30, message="nap to run")
    page.click("header >> text=Workers")
    nap_row = page.locator(f'tr[data-job="{job(runs, napping.id)["id"]}"]')
    expect(nap_row).to_contain_text("tests.apps.e2e_app.nap")
    expect(nap_row).to_contain_text("browser-nap")
    expect(page.locator("section.worker-alive .health")).to_contain_text("alive")
    shot(page, "admin-workers.png")

    # A job's page: every try of the flaky task (a retry is a new row), its error, its args.
    first_try = runs.execute("SELECT id FROM pgbroker.jobs WHERE task_id = %s AND retries = 0",
                             (flaky.id,)).fetchone()[0]
    page.goto(f"{admin_url}/jobs/{first_try}")
    expect(page.locator("h2", has_text="Its tries (3)")).to_be_visible()
    expect(page.locator("table.tries tbody tr")).to_have_count(3)
    expect(page.locator("pre.args")).to_contain_text("browser-flaky")
    shot(page, "admin-job.png")

    # The jobs browser: dead jobs whose arguments say "bulk"; retry all of them, confirmed.
    bulk = [e2e.touch.apply_async(args=[f"bulk-{i}"]) for i in range(3)]
    wait_for(lambda: all(key_runs(runs, f"bulk-{i}") for i in range(3)), 60,
             message="the bulk jobs to run once")
    runs.execute("UPDATE pgbroker.jobs SET state = 'dead', last_error = 'IOError: disk full'"
                 " WHERE task_id = ANY(%s)", ([r.id for r in bulk],))
    page.click("header >> text=Jobs")
    page.select_option("select[name=state]", "dead")
    page.fill("input[name=text]", "bulk-")
    page.click("form.filters button")
    expect(page.locator("table.jobs tbody tr[data-job]")).to_have_count(3)
    shot(page, "admin-jobs.png")
    page.click("text=Retry the dead ones…")
    expect(page.locator(".confirm-box .big")).to_have_text("3")
    shot(page, "admin-bulk.png")
    page.click("button.big-button")
    expect(page.locator(".flash.ok")).to_have_text("Retried 3 job(s).")
    wait_for(lambda: all(len(key_runs(runs, f"bulk-{i}")) == 2 for i in range(3)), 60,
             message="the worker to run the retried jobs")

    # Bulk cancel of what waits in a paused queue: it never runs.
    later = [e2e.touch.apply_async(args=[f"later-{i}"], countdown=3600) for i in range(2)]
    page.goto(f"{admin_url}/jobs?text=later-")
    page.click("text=Cancel the pending and scheduled ones…")
    expect(page.locator(".confirm-box .big")).to_have_text("2")
    page.click("button.big-button")
    expect(page.locator(".flash.ok")).to_have_text("Cancelled 2 job(s).")
    assert {job(runs, r.id)["state"] for r in later} == {"cancelled"}

    # Beat: the 1-second entry disabled, the hourly one run now (the real beat fires it).
    page.click("header >> text=Beat")
    tick = page.locator('tr[data-entry="tick"]')
    expect(tick).to_contain_text("● enabled")
    tick.locator("button.pause").click()
    expect(tick).to_contain_text("○ disabled")
    hourly = page.locator('tr[data-entry="hourly-touch"]')
    expect(hourly).to_contain_text("never")
    hourly.locator("button.retry").click()
    expect(page.locator(".flash.ok")).to_contain_text("will run at beat's next tick")
    wait_for(lambda: key_runs(runs, "beat-run-now"), 60, message="beat and the worker to run it")
    page.reload()
    expect(hourly.locator(".state")).to_have_text("completed", timeout=30_000)
    shot(page, "admin-beat.png")

    # The poison job's page shows its payload as text; no script ever ran.
    page.goto(f"{admin_url}/jobs/{poison_id}")
    expect(page.locator("pre.body")).to_contain_text("<script>alert('body')</script>")
    assert page.dialogs == []

    audit = [a for a, in runs.execute("SELECT action FROM pgbroker.audit WHERE actor = %s"
                                      " ORDER BY id", (USER,))]
    assert audit == (["dead.retry", "queue.pause", "queue.resume", "jobs.bulk_retry"]
                     + ["dead.retry"] * 3 + ["jobs.bulk_cancel"] + ["job.cancel"] * 2
                     + ["schedule.disable", "schedule.run_now"])
    worker.stop()
    beat.stop()


def test_a_viewer_looks_and_a_logout_ends_the_session(runs: psycopg.Connection,
                                                       admin_url: str, browser) -> None:
    expect = sync_api.expect
    runs.execute("INSERT INTO pgbroker.queues (name) VALUES ('celery')")
    dead = add_job(runs, "dead", queue="celery", last_error="ValueError: boom")
    page = new_page(browser, admin_url, VIEWER, VIEWER_PASSWORD)
    expect(page.locator(".viewer-badge")).to_have_text("read-only")
    for path in ("/", "/workers", "/jobs?state=dead", f"/jobs/{dead}", "/dead", "/beat",
                 "/audit", "/queues/celery"):
        page.goto(admin_url + path)
        expect(page.locator("main form[method=post]")).to_have_count(0)
        expect(page.locator("main a.button.danger, main a.button.retry")).to_have_count(0)
    saved = page.context.cookies()
    page.click("form.logout button")
    expect(page).to_have_url(re.compile(r"/login$"))

    thief = browser.new_context()
    thief.add_cookies(saved)
    stolen = thief.new_page()
    stolen.goto(admin_url + "/")
    expect(stolen).to_have_url(re.compile(r"/login\?next="))
    thief.close()
