"""The project's own metadata: what it claims holds for the interpreter that runs the tests."""

import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def test_running_python_is_one_the_project_claims():
    """pyproject's requires-python admits the interpreter running the tests, and not Python 3.10, which lacks the
    standard library's tomllib that rail/config.py and rail/lab/ablate.py import."""
    spec = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert "3.10" not in spec  # tomllib: rail/config.py and rail/lab/ablate.py import it
    assert "3.11" in spec
    assert "{}.{}.{}".format(*sys.version_info[:3]) in spec, (spec, sys.version)
