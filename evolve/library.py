"""Policies by name: a built-in of policy_dsl's library or a .akvp file."""
from __future__ import annotations

from evolve.candidate import Checked, check_policy
from policy_dsl import PolicyError, builtin_names
from policy_dsl.library import read_source


class UnknownPolicy(ValueError):
    pass


def load_checked(name: str) -> Checked:
    """Parse, validate and canonicalize a built-in or a file; UnknownPolicy with a one-line reason."""
    try:
        filename, text = read_source(name)
        return check_policy(text, filename=filename)
    except PolicyError as err:
        raise UnknownPolicy(str(err)) from None


# Built-ins written by hand for this project's suites after looking at their trajectories
# (docs/policy-dsl.md): a proposer that borrows from them copies the answer instead of finding it.
SUITE_SPECIFIC = frozenset({"research", "drop-stale", "drop-settled"})


def library_texts() -> list[str]:
    """Canonical texts of the general built-ins (the proposers' donor pool and examples): upstream's
    policies and the baselines, not the suite-specific ones (SUITE_SPECIFIC)."""
    return [load_checked(name).text for name in builtin_names() if name not in SUITE_SPECIFIC]
