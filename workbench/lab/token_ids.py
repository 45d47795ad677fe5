"""TokenIds: a prompt's token ids, checked once.

A tuple (it compares, hashes and prints as one) whose every element is a Python ``int``.
``TokenIds(ids)`` checks any sequence of integers, converting numpy integers, and a 1-D numpy
integer array by its dtype with one ``tolist()``; anything else is a ValueError. A slice of
a TokenIds, and a TokenIds plus a TokenIds, are TokenIds with no second check (anything
else behaves as with a tuple). So prompts cut from a corpus checked once
(:mod:`workbench.lab.corpus_prompts`) cost no pass over their ids when a
:class:`~workbench.lab.workload.WorkloadRequest` takes them.

A WorkloadRequest keeps a plain tuple of them: the cycle collector stops tracking a tuple of
ints at its first pass, never a tuple subclass, and a large workload's prompts would
otherwise be walked by every full collection (0.3 s for 100,000 prompts).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class TokenIds(tuple):
    """A tuple of Python ints (see the module docstring); ValueError for anything else."""

    __slots__ = ()

    def __new__(cls, ids: Iterable = ()) -> TokenIds:
        if type(ids) is cls:
            return ids
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise ValueError(f"token ids must be integers, got a {ids.ndim}-D array of {ids.dtype}.")
            return tuple.__new__(cls, ids.tolist())
        ids = tuple(ids)
        if set(map(type, ids)) - {int}:  # one pass in C for the usual plain ints
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"token ids must be integers, got {t!r}.")
            ids = map(int, ids)
        return tuple.__new__(cls, ids)

    def __getitem__(self, index):
        item = tuple.__getitem__(self, index)
        return tuple.__new__(TokenIds, item) if isinstance(index, slice) else item

    def __add__(self, other):
        joined = tuple.__add__(self, other)
        return tuple.__new__(TokenIds, joined) if type(other) is TokenIds else joined
