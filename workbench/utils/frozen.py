"""FrozenDict: a dict that refuses changes once built -- the mappings a StepRecord keeps.

It reads, compares, pickles and deep-copies as the dict it holds (a forked engine's history
copies it), so a record handed to its observers cannot be changed by any of them.
"""

from __future__ import annotations


class FrozenDict(dict):
    """A read-only dict (every mutating method raises TypeError)."""

    __slots__ = ()

    def _read_only(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is read-only: it belongs to an immutable record.")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self):
        return type(self), (dict(self),)

    def __repr__(self) -> str:
        return dict.__repr__(self)
