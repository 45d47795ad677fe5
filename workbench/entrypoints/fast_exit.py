"""Ending a finished console command without tearing its heap down.

When ``workbench simulate`` of 100,000 requests has printed its summary, the process holds
about 15 million objects (the RunResult's kept StepRecords and request metrics, the
workload); freeing them one by one, then the interpreter's own finalization, took ~3.4 s on
a 2-vCPU machine after the work was done. So the console script (:func:`console_command`
around ``main()``) lets a command that finished its work end the process at once with
``os._exit``: :func:`finish` first flushes stdout and stderr, runs the atexit functions
(logging's shutdown among them, which flushes and closes its handlers), and does it only
while no thread but the main one and daemon threads runs (a non-daemon thread would be
joined at a normal exit: then it returns, and the interpreter exits as usual; daemon
threads, such as tqdm's monitor, are abandoned by a normal exit too). What it skips is only the freeing of memory the operating system takes back.

``main()`` called in-process (tests, notebooks) is never ended: :func:`finish` returns the
exit code. A command opts in by returning ``finish(code)`` once its files are closed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

_console = False  # inside console_command(): the process is the `workbench` console script


@contextlib.contextmanager
def console_command() -> Iterator[None]:
    """While entered, :func:`finish` may end the process (the console script's ``main()``)."""
    global _console
    _console = True
    try:
        yield
    finally:
        _console = False


def finish(code: int) -> int:
    """End the process now with ``code`` when run by the console script and no non-daemon
    thread but the main one runs (see the module docstring); else return ``code``."""
    main = threading.main_thread()
    if not _console or any(t is not main and not t.daemon for t in threading.enumerate()):
        return code
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
