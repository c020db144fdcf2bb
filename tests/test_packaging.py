"""What a wheel carries: every file the package reads at run time must match pyproject.toml's
package-data (a wheel without the kernels' headers cannot build them; an editable install hides
that, since it reads the source tree)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _packaged() -> set[Path]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    return {p for pattern in data["specserve"] for p in (ROOT / "specserve").glob(pattern)}


def test_the_kernel_sources_are_package_data():
    from specserve.kernels.build import _sources

    missing = [p.name for p in _sources() if p not in _packaged()]
    assert not missing, f"not in the wheel: {missing}"


def test_every_tracked_data_file_is_package_data():
    tracked = subprocess.run(["git", "ls-files", "specserve"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:  # not a git checkout (an sdist): nothing to compare with
        return
    data = [ROOT / f for f in tracked.stdout.split() if not f.endswith((".py", ".log"))]
    missing = [str(p.relative_to(ROOT)) for p in data if p not in _packaged()]
    assert not missing, f"not in the wheel: {missing}"
