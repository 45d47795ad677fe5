"""A busy state for buttons: while a click runs, its controls are disabled and say so."""

from __future__ import annotations

import contextlib
import html


@contextlib.contextmanager
def busy(controls, status, message: str):
    """Disable ``controls`` and show ``message`` in the ``status`` HTML widget while the body
    runs; afterwards re-enable them and show "ready", or the error (never a traceback)."""
    for control in controls:
        control.disabled = True
    status.value = f"<span style='color:#b36b00'>⏳ {html.escape(message)}…</span>"
    try:
        yield
    except Exception as error:  # shown to the person who clicked, not lost in a log
        status.value = f"<span style='color:#c00'>✗ {html.escape(type(error).__name__)}: {html.escape(str(error))}</span>"
    else:
        status.value = "<span style='color:#2a7'>✓ ready</span>"
    finally:
        for control in controls:
            control.disabled = False
