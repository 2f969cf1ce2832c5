"""The settings of a refining proxy (`akv proxy --refine`), from its flags or a `refine:` block of a config file.

Every setting is checked before the proxy starts: one out of range, or an unknown proposer, is
`error: --refine-window: ...` (or `error: FILE:LINE: refine.window: ...`) and exit status 2.
Flags win over the file's values.
"""
from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# setting -> its flag
FLAGS = {"every": "--refine-every", "period": "--refine-period", "window": "--refine-window",
         "idle": "--refine-idle", "timeout": "--refine-timeout", "budget": "--refine-budget",
         "proposers": "--refine-proposers", "dry_run": "--refine-dry-run"}


def known_proposers() -> tuple[str, ...]:
    """The proposers `akv evolve` knows, as its config declares them."""
    from evolve.config import EvolveConfig

    [literal] = typing.get_args(EvolveConfig.model_fields["proposers"].annotation)
    return typing.get_args(literal)


class RefineSettings(BaseModel):
    """When the refiner evolves, on what, with which budget, and whether it may promote."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every: int = Field(50, ge=1, description="New finished conversations that start an evolution.")
    period: Optional[float] = Field(None, gt=0, description="Seconds after which an evolution starts on any new "
                                    "finished conversation, however few (default: none, `every` alone).")
    window: int = Field(200, ge=4, description="The latest finished conversations an evolution runs on "
                        "(split train / held-out by the usual hash; at least 4).")
    idle: float = Field(300.0, gt=0, description="Seconds without a request after which a conversation is finished.")
    timeout: float = Field(3600.0, gt=0, description="Seconds an evolution may take; one that runs longer is "
                           "stopped and changes nothing.")
    budget: Optional[int] = Field(None, ge=1, description="Candidates per evolution (default: `akv evolve`'s).")
    proposers: Optional[tuple[str, ...]] = Field(None, min_length=1, description="Proposers of each evolution "
                                                 "(default: `akv evolve`'s for trace sets).")
    dry_run: bool = Field(False, description="Evolve and judge, never promote.")

    @field_validator("proposers")
    @classmethod
    def _known(cls, names: tuple[str, ...] | None) -> tuple[str, ...] | None:
        known = known_proposers()
        for name in names or ():
            if name not in known:
                raise ValueError(f"unknown proposer {name!r}: expected {', '.join(known)}")
        return names

    def evolve_overrides(self) -> dict[str, Any]:
        """The `akv evolve` settings these give (those left unset keep evolve's defaults)."""
        return {"max_candidates": self.budget, "proposers": list(self.proposers) if self.proposers else None}


class SettingsError(ValueError):
    """A setting out of range; the message names the flag or FILE:LINE and the setting."""


def refine_settings(flags: Mapping[str, Any], config: Path | None) -> RefineSettings:
    """The settings of `flags` (those not None) over the `refine:` block of `config`; SettingsError otherwise."""
    from_file, lines = _file_settings(config) if config is not None else ({}, {})
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return RefineSettings.model_validate({**from_file, **given})
    except ValidationError as err:
        problems = []
        for e in err.errors():
            key = str(e["loc"][0]) if e["loc"] else ""
            where = FLAGS[key] if key in given else f"{config}:{lines.get(key, 1)}: refine.{key}"
            problems.append(f"{where}: {_message(e)}")
        raise SettingsError("\n".join(problems)) from None


def _message(error: Mapping[str, Any]) -> str:
    """What was expected, in words, and what was given."""
    bound = error.get("ctx") or {}
    if error["type"] == "extra_forbidden":
        return f"unknown setting; expected one of {', '.join(FLAGS)}"
    if error["type"] == "greater_than_equal":
        return f"expected at least {bound['ge']}, got {error['input']}"
    if error["type"] == "greater_than":
        return f"expected more than {bound['gt']:g}, got {error['input']}"
    return error["msg"].removeprefix("Value error, ")


def _file_settings(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The `refine:` mapping of a YAML file and the line of each of its keys."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise SettingsError(f"--config: cannot read {path}: {err.strerror}") from None
    try:
        data, node = yaml.safe_load(text) or {}, yaml.compose(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise SettingsError(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML") from None
    if not isinstance(data, dict) or set(data) - {"refine"}:
        extra = next(iter(set(data) - {"refine"}), None) if isinstance(data, dict) else None
        raise SettingsError(f"{path}:{_line(node, extra)}: expected a mapping with one key, refine"
                            + (f"; {extra!r} is not a proxy setting" if extra else ""))
    block = data.get("refine") or {}
    if not isinstance(block, dict):
        raise SettingsError(f"{path}:{_line(node, 'refine')}: refine: expected a mapping of settings")
    refine = next((v for k, v in node.value if k.value == "refine"), None) if node is not None else None
    keys = refine.value if isinstance(refine, yaml.MappingNode) else []
    lines = {str(k.value): k.start_mark.line + 1 for k, _ in keys}
    return block, lines


def _line(node: Any, key: str | None) -> int:
    if isinstance(node, yaml.MappingNode):
        for k, _ in node.value:
            if k.value == key:
                return k.start_mark.line + 1
    return 1
