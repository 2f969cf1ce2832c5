"""How the command line's help looks: a flag shows no value type (Typer labels it `<bool>`)."""
from __future__ import annotations

from typing import Any

from typer.core import TyperOption


def flags_show_no_type() -> None:
    """Make every flag's help row show no type: a flag takes no value, so `<bool>` misleads."""
    shown = TyperOption.display_type_rich
    if getattr(shown, "flags_show_no_type", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.flags_show_no_type = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]
