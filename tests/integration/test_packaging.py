"""The distributions a user installs in their own app: ``python -m build`` makes an sdist and,
from it, a wheel; both must carry the files pgbroker reads at run time (SQL, migrations, the
admin page's templates and static files), and the wheel, installed into a fresh venv, must work.

No database is needed. The build runs without isolation (``build``, ``setuptools`` and ``wheel``
come with the ``dev`` extra), and the fresh venv's dependencies come from pip's cache, so the
test needs no network beyond the package index pip is configured with.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT

#: Files pgbroker opens at run time, relative to the repository: each must be in both artefacts.
RUNTIME_GLOBS = ("pgbroker/sql/*.sql", "pgbroker/sql/migrations/*.sql",
                 "pgbroker/admin/templates/*.html", "pgbroker/admin/static/*", "pgbroker/py.typed")


def runtime_files() -> set[str]:
    found = {str(p.relative_to(REPO_ROOT)) for g in RUNTIME_GLOBS for p in REPO_ROOT.glob(g)}
    assert "pgbroker/sql/migrations/0001_initial.sql" in found  # the globs find something
    return found


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel built from it (what ``python -m build`` does)."""
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                           str(REPO_ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_the_wheel_holds_the_sql_migrations_templates_and_static_files(
        dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
        entry_points = whl.read(next(n for n in names if n.endswith("entry_points.txt")))
    assert runtime_files() <= names, sorted(runtime_files() - names)
    assert b"pgbroker = pgbroker.cli:main" in entry_points
    # the demo application stays in the repository: an app of one's own may be named ticketflow
    assert not [n for n in names if n.startswith("ticketflow/")]


def test_the_sdist_holds_them_too_with_what_the_wheel_is_built_from(
        dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as sdist:
        top = sdist.getnames()[0].split("/")[0]  # pgbroker-<version>
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    wanted = runtime_files() | {"README.md", "setup.cfg", "pyproject.toml"}
    assert wanted <= names, (top, sorted(wanted - names))


def test_the_wheel_installed_in_a_fresh_venv_imports_and_finds_its_sql(
        dist: dict[str, Path], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # this venv's pip installs into the new one (no second pip to set up); dependencies come
    # from pip's cache. With the admin extra, as the README installs it.
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                           f"{dist['wheel']}[admin]"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probe = (
        "import importlib.resources as r, pgbroker\n"
        "from pgbroker._pg.catalogue import queries\n"
        "from pgbroker.migrate import latest_version\n"
        "assert 'site-packages' in pgbroker.__file__, pgbroker.__file__\n"
        "assert 'job_claim' in queries('pgbroker') and latest_version() >= 4\n"
        "admin = r.files('pgbroker.admin')\n"
        "assert admin.joinpath('static', 'htmx.min.js').is_file()\n"
        "assert any(p.name.endswith('.html') for p in admin.joinpath('templates').iterdir())\n"
        "print('ok', latest_version())\n")
    # run outside the repository, so that nothing but the installed wheel can be imported
    ran = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.startswith("ok"), ran.stdout + ran.stderr
    cli = subprocess.run([str(venv / "bin" / "pgbroker"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "usage: pgbroker" in cli.stdout, cli.stderr
