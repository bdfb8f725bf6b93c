"""The one error of the text layer: a chat or prompt the recipe refuses."""
from __future__ import annotations

from typing import Any


class RecipeError(ValueError):
    """A chat the recipe refuses: malformed messages, or a template that fails or misbehaves."""


def short(value: Any) -> str:
    """`value`'s repr, cut to 60 characters (for error messages about untrusted input)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
