"""The built-in policies (policy_dsl/library/*.akvp) and loading a policy by name or path."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from policy_dsl.errors import PolicyError, PolicyLimitError
from policy_dsl.parser import MAX_SOURCE_BYTES, decode_source, parse
from policy_dsl.policy import CachePolicy, compile_policy

SUFFIX = ".akvp"


def builtin_names() -> list[str]:
    """Names of the shipped policies, sorted."""
    folder = resources.files("policy_dsl").joinpath("library")
    return sorted(p.name[: -len(SUFFIX)] for p in folder.iterdir() if p.name.endswith(SUFFIX))


def builtin_source(name: str) -> str:
    """The shipped text of a built-in policy (comments included)."""
    if name not in builtin_names():
        raise PolicyError(f"unknown built-in policy {name!r}; expected one of {', '.join(builtin_names())}",
                          filename=name)
    return resources.files("policy_dsl").joinpath("library", name + SUFFIX).read_text(encoding="utf-8")


def read_source(name_or_path: str) -> tuple[str, str]:
    """(filename, text) of a built-in name or a policy file; raises PolicyError with a location."""
    if name_or_path in builtin_names():
        return f"{name_or_path}{SUFFIX}", builtin_source(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise PolicyError(f"no built-in policy and no file named {name_or_path!r}; "
                          f"built-ins: {', '.join(builtin_names())}", filename=name_or_path)
    try:
        size = path.stat().st_size
        if size > MAX_SOURCE_BYTES:  # refuse before reading: the file may be huge
            raise PolicyLimitError(f"policy is {size} bytes; the limit is {MAX_SOURCE_BYTES}", filename=name_or_path)
        data = path.read_bytes()
    except OSError as err:
        raise PolicyError(f"cannot read the file: {err.strerror}", filename=name_or_path) from None
    return name_or_path, decode_source(data, name_or_path)


def load_policy(name_or_path: str) -> CachePolicy:
    """A built-in by name ("expert") or a .akvp file, parsed, validated and compiled."""
    filename, text = read_source(name_or_path)
    name = name_or_path if name_or_path in builtin_names() else Path(name_or_path).stem
    return compile_policy(parse(text, filename=filename), name=name)
