"""moewire.extras: the install command a refusal names installs moewire's clone with the
extra (moewire is not on a package index), or the extra's packages outside a clone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import moewire.extras as extras

ROOT = Path(__file__).resolve().parents[1]


def test_in_the_clone_the_command_installs_the_clone_with_the_extra():
    assert extras.install_command("eval") == f"{sys.executable} -m pip install -e '{ROOT}[eval]'"


def test_outside_a_clone_the_command_names_the_packages(monkeypatch, tmp_path):
    fake = tmp_path / "site-packages" / "moewire" / "extras.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(extras, "__file__", str(fake))
    command = extras.install_command("eval")
    assert command.endswith("install lm-eval==0.4.13 'accelerate>=0.26' "
                            "'transformers>=5.23,<5.24'")
    assert "moewire[" not in command


def test_every_extra_of_pyproject_has_packages():
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(extras.PACKAGES) == set(declared) - {"test"}


def test_an_unknown_extra_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="'gpus' is not one of moewire's extras"):
        extras.install_command("gpus")
