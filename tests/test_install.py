"""The install declares a torch range (not a pin), so it coexists with the torch a user has.

The README's install command pins the CPU wheel explicitly; the library must not.
`scripts/check_install_keeps_torch.sh` checks the same against a real `pip install`."""
from __future__ import annotations

import pathlib

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _requirements() -> dict[str, Requirement]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name: Requirement(r) for r in meta["dependencies"]}


def test_torch_is_a_range_that_admits_recent_releases():
    torch_req = _requirements()["torch"]
    assert not any(s.operator in ("==", "===") for s in torch_req.specifier), torch_req
    for version in ("2.5.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1"):
        assert torch_req.specifier.contains(version), (torch_req, version)


def test_base_install_stays_small():
    assert set(_requirements()) == {"torch", "einops"}


def test_readme_and_ci_pin_the_cpu_wheel_explicitly():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()[0]
    assert install == 'pip install torch==2.13.0 -e ".[test]"'
    assert install in (ROOT / ".ci" / "run").read_text()
