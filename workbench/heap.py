"""frozen_heap(): keep the objects alive at the start of a run out of the cycle collector's way.

A process that imported torch and transformers holds hundreds of thousands of long-lived
objects; every full (oldest-generation) collection walks all of them, about 0.15 s on a
2-core CPU, and the garbage of a few hundred engine steps is enough to trigger one. vLLM
freezes its engine core's heap after start-up for the same reason. Here the freeze is scoped
to a run (``LLM.generate``, a workload's drive): objects alive on entry sit in the permanent
generation until exit, then go back to the oldest one, so nothing is leaked; garbage made
during the run is collected as usual.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """``gc.freeze()`` on entry, ``gc.unfreeze()`` on exit. Does nothing when something else
    already froze objects (an outer run, or the application's own freeze), so it nests."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
