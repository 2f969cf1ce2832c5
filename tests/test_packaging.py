"""The distribution's metadata: a free name, an SPDX license, the README's list of built-ins."""
from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_distribution_name_is_not_the_package_index_s_unrelated_akv() -> None:
    name = project()["project"]["name"]
    assert name == "akv-agents"
    installed = metadata.distribution(name)
    assert any(e.name == "akv" and e.group == "console_scripts" for e in installed.entry_points)


def test_the_license_is_an_spdx_expression_with_its_text_shipped() -> None:
    """A `project.license` table makes setuptools warn twice on every install; a string does not."""
    spec = project()
    assert spec["project"]["license"] == "Apache-2.0"
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77
               for r in spec["build-system"]["requires"])
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")


def test_the_readme_names_every_built_in_policy() -> None:
    listed = (ROOT / "README.md").read_text(encoding="utf-8").split("The built-ins (", 1)[1].split(")", 1)[0]
    names = {p.stem for p in (ROOT / "policy_dsl" / "library").glob("*.akvp")}
    def as_variant(name: str) -> bool:
        base, _, size = name.rpartition("-")
        return size in ("8k", "32k") and f"`{base}`" in listed and f"`-{size}` variants" in listed

    missing = sorted(n for n in names if f"`{n}`" not in listed and not as_variant(n))
    assert not missing, f"README's list of built-ins lacks {missing}"
