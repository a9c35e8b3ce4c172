"""The helpers of the Django tier: ``manage.py`` of the test project in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.processes import REPO_ROOT

__all__ = ["manage"]


def manage(db_url: str, *args: str, settings: str = "tests.apps.django_project.settings",
           env: dict[str, str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m django ARGS`` (``manage.py ARGS``) for the test project on ``db_url``;
    stdout and stderr captured as text."""
    full = {**os.environ, "DJANGO_SETTINGS_MODULE": settings, "PGBROKER_DATABASE_URL": db_url,
            "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "django", *args], cwd=REPO_ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)
