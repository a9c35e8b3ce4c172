"""kombu's own integration suite, read from the sdist of the INSTALLED kombu version.

``t/integration/common.py`` is not part of kombu's wheel. It is downloaded once per run with
pip (``pip download kombu==<installed> --no-deps --no-binary :all:``) into pytest's cache
(``.pytest_cache/d/kombu-sdist``) and imported from there, unmodified: the file is never copied
into this repository, so the suite is always the one of the kombu version pgbroker runs with.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import kombu

#: Where the sdist is kept; set by conftest.py from pytest's cache (a tmp dir without one).
cache_dir: Path | None = None

MEMBER = "t/integration/common.py"


def _download(into: Path) -> Path:
    """The sdist tarball of the installed kombu in ``into`` (downloaded if absent)."""
    version = kombu.__version__
    found = sorted(into.glob(f"kombu-{version}.tar.gz"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"kombu=={version}", "--no-deps",
             "--no-binary", ":all:", "--disable-pip-version-check", "-q", "-d", str(into)],
            check=True, capture_output=True, text=True, timeout=300)
        found = sorted(into.glob(f"kombu-{version}.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip left no kombu-{version}.tar.gz in {into}")
    return found[0]


def load_common() -> ModuleType:
    """kombu's ``t/integration/common.py`` as a module.

    Raises:
        RuntimeError: the sdist could not be downloaded or has no such file (the reason says
            why; the caller skips the suite with it).
    """
    into = cache_dir or Path(tempfile.gettempdir()) / "pgbroker-kombu-sdist"
    into.mkdir(parents=True, exist_ok=True)
    version = kombu.__version__
    target = into / f"kombu-{version}-common.py"
    if not target.exists():
        try:
            tarball = _download(into)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"pip download kombu=={version} failed: "
                               f"{(exc.stderr or exc.stdout or '').strip()[-500:]}") from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"pip download kombu=={version} failed: {exc}") from exc
        with tarfile.open(tarball) as archive:
            member = archive.getmember(f"kombu-{version}/{MEMBER}")
            source = archive.extractfile(member)
            assert source is not None
            part = target.with_suffix(".part")
            part.write_bytes(source.read())
            part.replace(target)  # another process may read it meanwhile: never half a file
    spec = importlib.util.spec_from_file_location("kombu_t_integration_common", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
