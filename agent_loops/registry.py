"""Name -> agent-loop class. Only registered loops can be chosen by config or by a row."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T", bound=type)

_LOOPS: dict[str, type] = {}


def register_agent_loop(name: str) -> Callable[[T], T]:
    """Class decorator: `@register_agent_loop("partial_single_turn")`."""

    def decorate(cls: T) -> T:
        if name in _LOOPS and _LOOPS[name] is not cls:
            raise ValueError(f"agent loop {name!r} is already registered by {_LOOPS[name].__qualname__}")
        _LOOPS[name] = cls
        return cls

    return decorate


def get_agent_loop(name: str) -> type:
    try:
        return _LOOPS[name]
    except KeyError:
        known = ", ".join(sorted(_LOOPS)) or "none registered"
        raise KeyError(f"unknown agent loop {name!r}; registered loops: {known}") from None


def registered_agent_loops() -> list[str]:
    return sorted(_LOOPS)


def any_uses_tools(names: Iterable[str]) -> bool:
    """Whether one of these loops runs tools (names of no registered loop are left out)."""
    return any(_LOOPS[name].uses_tools for name in names if name in _LOOPS)
