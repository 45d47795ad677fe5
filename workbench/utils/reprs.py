"""HTML repr helper: a titled two-column table (name, value), values escaped."""

from __future__ import annotations

import html
from collections.abc import Mapping


def html_table(title: str, rows: Mapping[str, object]) -> str:
    cells = "".join(
        f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
        f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
        for k, v in rows.items()
    )
    return f"<b>{html.escape(title)}</b><table>{cells}</table>"
