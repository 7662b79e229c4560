"""One registry of what must see each packed document alone, and the one switch the tests use to show the leak.

A packed row holds many documents; attention keeps them apart through `cu_seqlens`, but some modules read the
whole row unless run per document: token mixers (convolutions, SSM and linear-attention states), rotary tables
whose factors depend on the largest position, indexers that choose among earlier tokens. Each such module
registers its kind here and asks `isolating(kind)` before it splits the row. Tests turn isolation off with
`leaking(kind)` to show that the difference it removes is real (a test that could not fail would prove nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_registered: dict[str, str] = {}  # kind -> what it keeps apart, in the order the modules registered
_leaking: set[str] = set()


def register(kind: str, what: str) -> str:
    """Register `kind` (what it keeps apart in `what`); returns the kind, for the module to keep as its name."""
    if _registered.get(kind, what) != what:
        raise ValueError(f"isolation kind {kind!r} is registered twice, as {_registered[kind]!r} and {what!r}")
    _registered[kind] = what
    return kind


def registered() -> dict[str, str]:
    """{kind: what it keeps apart} of every registered kind."""
    return dict(_registered)


def isolating(kind: str) -> bool:
    """Whether `kind` runs each document alone (always, outside a test's `leaking`)."""
    return kind not in _leaking


@contextmanager
def leaking(*kinds: str) -> Iterator[None]:
    """Tests only: the named kinds (every registered one when none is named) read the whole row while the block
    runs, as transformers' own modules do: the leak isolation removes."""
    unknown = [kind for kind in kinds if kind not in _registered]
    if unknown:
        raise ValueError(f"no isolation kind {unknown}; registered: {sorted(_registered)}")
    turned_off = set(kinds or _registered) - _leaking
    _leaking.update(turned_off)
    try:
        yield
    finally:
        _leaking.difference_update(turned_off)
