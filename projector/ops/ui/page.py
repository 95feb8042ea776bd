"""The one HTML page of the pictures, self-contained: uPlot, its style and the page's script
inline, so that neither ``seqstate report``'s file nor the live ``/ui`` ever fetches anything
from another machine (uPlot 1.6.32, MIT, vendored from the npm package ``uplot`` beside this
module with its licence).

The report's page carries its points; the live page carries none and a ``data_url`` that the
script asks once a second for the next point.
"""

from __future__ import annotations

import html
import json
from functools import cache
from importlib import resources
from typing import Any, Final

from projector.ops.ui.sample import MAX_PUBLISHERS, MAX_WORKERS, Point

MAX_POINTS: Final = 600  # per series: what a report samples, what the live page keeps

CHARTS: Final = (
    ("blocks", "Active decode blocks per worker/rank", "no worker in this namespace yet"),
    ("prefill", "Prefill tokens pending per worker/rank", "no worker in this namespace yet"),
    ("rate", "Events folded per second", "no events yet"),
    ("faults", "Dead letters and Dynamo messages lost (cumulative)", "no events yet"),
    (
        "oldest",
        "Age of the oldest request in flight",
        "a projector's image of the bucket holds no request ages: see the writer's page",
    ),
    (
        "capture",
        "Capture rate of each Dynamo publisher (frontend), % of its messages the log got",
        "no Dynamo publisher in this namespace",
    ),
)

STYLE: Final = """
body { font: 14px system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 18px 0 4px; }
.meta, .note, #status { color: #666; } .chart { max-width: 1000px; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: left; }
tr:nth-child(even) { background: #f4f4f4; }
"""


def _nav(links: list[tuple[str, str]], more: int) -> str:
    if not links:
        return ""
    anchors = ", ".join(
        f'<a href="{html.escape(href)}">{html.escape(name)}</a>' for name, href in links
    )
    rest = f" and {more} more" if more else ""
    return f'<nav class="meta" id="namespaces">other namespaces here: {anchors}{rest}</nav>'


@cache
def _asset(name: str) -> str:
    return (resources.files(__package__) / name).read_text(encoding="utf-8")


def render(
    title: str,
    meta: str,
    points: list[Point] | None = None,
    data_url: str | None = None,
    links: list[tuple[str, str]] | None = None,
    links_more: int = 0,
) -> str:
    """The page: ``points`` drawn at once (a report), or fetched from ``data_url`` (live);
    ``links``, ``(name, href)`` of the other namespaces' pages (``links_more`` not listed)."""
    config: dict[str, Any] = {
        "points": points or [],
        "data_url": data_url,
        "max_points": MAX_POINTS,
        "max_workers": MAX_WORKERS,
        "max_publishers": MAX_PUBLISHERS,
    }
    # Inside <script>, "</" would end the element: JSON allows "<\/" for it.
    data = json.dumps(config, separators=(",", ":")).replace("</", "<\\/")
    charts = "\n".join(
        f'<div class="chart" id="{key}" data-none="{html.escape(none)}"><h2>{html.escape(name)}'
        f'</h2><div class="note"></div><div class="plot"></div></div>'
        for key, name, none in CHARTS
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(title)}</title><link rel="icon" href="data:,">
<style>{_asset("uPlot.min.css")}</style><style>{STYLE}</style>
</head><body>
<h1>{html.escape(title)}</h1>
<div class="meta">{html.escape(meta)}</div>{_nav(links or [], links_more)}<div id="status"></div>
{charts}
<h2>Oldest requests in flight</h2>
<table id="oldest-table"><thead><tr><th>request</th><th>worker/rank</th><th>age (s)</th></tr>
</thead><tbody></tbody></table>
<script id="seqstate-data" type="application/json">{data}</script>
<script>/* uPlot, MIT licence:
{_asset("uPlot.LICENSE")}*/
{_asset("uPlot.iife.min.js")}</script>
<script>{_asset("page.js")}</script>
</body></html>
"""
