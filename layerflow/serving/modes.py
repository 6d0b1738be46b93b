"""A scheduler option chosen by argument, else by environment variable, else its first (proven) mode."""

from __future__ import annotations

import os


def selected(name: str, value: str | None, env: str, modes: tuple[str, ...]) -> str:
    """`value`, else $`env`, else `modes[0]`; ValueError naming the argument or the variable when not in `modes`."""
    chosen = value or os.environ.get(env) or modes[0]
    if chosen not in modes:
        raise ValueError(f"{name if value else env}={chosen!r}: expected one of {modes}")
    return chosen
