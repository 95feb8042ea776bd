"""The load view: every number of every row is shown, unmodeled prefill is not shown as 0."""

from __future__ import annotations

import io

from rich.console import Console, RenderableType

from projector.ops.live import BAR_WIDTH, plain_table, render
from seqstate import LoadRow

HEADER = "worker  rank  requests  active_blocks  prefill_tokens  remaining_prefill_ms"
ROWS = [
    LoadRow(
        worker_id=3,
        dp_rank=0,
        active_blocks=1200,
        active_prefill_tokens=34567,
        active_requests=12,
        modeled_remaining_prefill_ms=850,
    ),
    LoadRow(
        worker_id=17,
        dp_rank=1,
        active_blocks=300,
        active_prefill_tokens=0,
        active_requests=3,
        modeled_remaining_prefill_ms=None,
    ),
    LoadRow(
        worker_id=42,
        dp_rank=0,
        active_blocks=0,
        active_prefill_tokens=0,
        active_requests=0,
        modeled_remaining_prefill_ms=0,
    ),
]


def text_of(renderable: RenderableType) -> str:
    console = Console(file=io.StringIO(), width=120, record=True)
    console.print(renderable)
    return console.export_text()


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("│")]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_render_shows_every_row_in_the_given_order() -> None:
    text = text_of(render(ROWS, title="seqstate loads"))
    assert "seqstate loads" in text
    for header in ("worker", "rank", "requests", "active blocks", "prefill tokens"):
        assert header in text
    first, second, third = (cells(line) for line in table_lines(text))
    assert first[:4] == ["3", "0", "12", "1,200"]
    assert first[5:] == ["34,567", "850"]
    assert second[:4] == ["17", "1", "3", "300"]
    assert second[5:] == ["0", "—"]  # unmodeled, not zero
    assert third[:4] == ["42", "0", "0", "0"]
    assert third[5:] == ["0", "0"]


def test_bars_are_relative_to_the_busiest_row_or_to_max_blocks() -> None:
    bars = [cells(line)[4] for line in table_lines(text_of(render(ROWS, title="t")))]
    assert bars == ["█" * BAR_WIDTH, "█" * (BAR_WIDTH // 4), ""]
    capped = [
        cells(line)[4] for line in table_lines(text_of(render(ROWS, title="t", max_blocks=600)))
    ]
    assert capped == ["█" * BAR_WIDTH, "█" * (BAR_WIDTH // 2), ""]  # over capacity: full


def test_stats_line_under_the_table() -> None:
    stats = {"events published": 123456, "applied seq": 99, "staleness ms": 12.25, "dlq": None}
    text = text_of(render(ROWS, title="t", stats=stats))
    last = text.rstrip().splitlines()[-1]
    assert last.split() == [
        "events",
        "published",
        "123,456",
        "applied",
        "seq",
        "99",
        "staleness",
        "ms",
        "12.2",
        "dlq",
        "—",
    ]


def test_render_without_rows() -> None:
    text = text_of(render([], title="idle"))
    assert "idle" in text and "no workers" in text
    assert table_lines(text) == []


def test_plain_table_is_aligned_ascii() -> None:
    assert plain_table(ROWS).splitlines() == [
        HEADER,
        "     3     0        12           1200           34567                   850",
        "    17     1         3            300               0                     -",
        "    42     0         0              0               0                     0",
    ]
    assert plain_table(ROWS).isascii()
    assert not plain_table(ROWS).endswith("\n")


def test_plain_table_widens_for_big_numbers() -> None:
    big = LoadRow(
        worker_id=2**40,
        dp_rank=7,
        active_blocks=5,
        active_prefill_tokens=1,
        active_requests=1,
        modeled_remaining_prefill_ms=None,
    )
    header, line = plain_table([big]).splitlines()
    assert header == " " * 7 + HEADER
    assert line == f"{2**40}     7         1              5               1                     -"
    assert plain_table([]) == HEADER
