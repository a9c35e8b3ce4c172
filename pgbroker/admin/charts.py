"""Server-side SVG charts: no script, no front-end build, nothing the page's CSP would refuse.

Each chart is an inline ``<svg role="img">`` with a title and a one-line description for screen
readers, a native tooltip (``<title>``) on every step, series told apart by colour *and* shape
(stacking order, dashes) with a text legend beside them, and the numbers themselves in a table
the template puts under it. Colours come from admin.css classes, so the page's stylesheet is the
one place they are set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from markupsafe import Markup, escape

from .stats import ORIGIN, Point, Window

__all__ = ["Series", "bar_chart", "format_count", "format_ms", "line_chart"]

WIDTH, HEIGHT = 600, 170
LEFT, RIGHT, TOP, BOTTOM = 50, 8, 8, 22
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
#: Seconds between the time axis' labels: the smallest that leaves at most 7 of them.
LABEL_STEPS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800)


@dataclass(frozen=True)
class Series:
    label: str
    css: str                                    #: class of admin.css: its colour (and dashes)
    value: Callable[[Point], float | None]


def format_count(n: float) -> str:
    if n >= 1_000_000:
        return f"{n / 1_000_000:.1f}M".replace(".0M", "M")
    if n >= 10_000:
        return f"{n / 1000:.0f}k"
    if n >= 1000:
        return f"{n / 1000:.1f}k".replace(".0k", "k")
    return f"{n:.0f}" if n == int(n) else f"{n:.1f}"


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "–"
    if ms == 0:
        return "0"
    if ms < 1:
        return f"{ms:.2f} ms"
    if ms < 10:
        return f"{ms:.1f} ms"
    if ms < 1000:
        return f"{ms:.0f} ms"
    s = ms / 1000
    if s < 10:
        return f"{s:.2f} s"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _nice(top: float, whole: bool = False) -> float:
    """The axis' top: four grid steps of a round size (1, 2, 2.5 or 5 times a power of ten;
    a whole number for counts) reaching ``top``."""
    step = max(top, 1e-9) / 4
    power: float = 10 ** math.floor(math.log10(step))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= step)
    return 4 * (max(1.0, math.ceil(step)) if whole else step)


def _nice_ms(top: float) -> float:
    """The axis' top for durations, in a round number of ms, s, min or h."""
    for unit in (1, 1000, 60_000, 3_600_000):
        if top <= unit * 1000 or unit == 3_600_000:
            return _nice(top / unit) * unit
    return top  # pragma: no cover


def _step_label(t: datetime, win: Window) -> str:
    if win.step >= 86400:
        return t.strftime("%m-%d")
    if win.until - win.since > timedelta(days=1):
        return t.strftime("%a %H:%M")
    return t.strftime("%H:%M")


def _span_text(t: datetime, win: Window) -> str:
    end = t + timedelta(seconds=win.step)
    fmt = "%Y-%m-%d %H:%M" if win.step >= 3600 or win.key in ("24h", "7d", None) else "%H:%M"
    return f"{t.strftime(fmt)}–{end.strftime('%H:%M')} UTC"


def _frame(title: str, summary: str, points: Sequence[Point], win: Window, top: float,
           label: Callable[[float], str]) -> list[str]:
    """The svg element, its accessible name, the horizontal grid and both axes' labels."""
    out = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
           f'aria-label="{escape(title)}: {escape(summary)}" preserveAspectRatio="xMidYMid meet">',
           f"<title>{escape(title)}</title><desc>{escape(summary)}</desc>"]
    for i in range(5):
        value = top * i / 4
        y = TOP + PLOT_H - PLOT_H * i / 4
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" '
                   f'y2="{y:.1f}"/>')
        out.append(f'<text class="axis" x="{LEFT - 6}" y="{y + 3.5:.1f}" '
                   f'text-anchor="end">{escape(label(value))}</text>')
    n = max(len(points), 1)
    span = n * win.step
    every = next((s for s in LABEL_STEPS if s >= win.step and span / s <= 7), LABEL_STEPS[-1])
    for i, p in enumerate(points):
        if (p.at - ORIGIN).total_seconds() % every == 0:  # at round times: 10:40, 10:50...
            x = LEFT + PLOT_W * (i + 0.5) / n
            out.append(f'<text class="axis" x="{x:.1f}" y="{HEIGHT - 6}" '
                       f'text-anchor="middle">{escape(_step_label(p.at, win))}</text>')
    return out


def _finish(out: list[str], points: Sequence[Point], win: Window,
            text: Callable[[Point], str], empty: str | None) -> Markup:
    """A transparent column per step whose tooltip gives the step's numbers; ``empty``: the
    sentence in the middle of a chart with nothing to draw."""
    n = max(len(points), 1)
    w = PLOT_W / n
    out += [f'<rect class="hover" x="{LEFT + w * i:.2f}" y="{TOP}" width="{w:.2f}" '
            f'height="{PLOT_H}"><title>{escape(_span_text(p.at, win))}: {escape(text(p))}'
            f"</title></rect>" for i, p in enumerate(points)]
    if empty:
        out.append(f'<text class="empty" x="{LEFT + PLOT_W / 2}" y="{TOP + PLOT_H / 2}" '
                   f'text-anchor="middle">{escape(empty)}</text>')
    out.append("</svg>")
    return Markup("".join(out))


def bar_chart(title: str, points: Sequence[Point], win: Window, series: Sequence[Series],
              empty: str) -> Markup:
    """Stacked bars, one per step, the first series at the bottom."""
    totals = [sum(s.value(p) or 0 for s in series) for p in points]
    top = _nice(max(totals, default=0), whole=True)
    grand = sum(totals)
    peak = max(range(len(points)), key=lambda i: totals[i], default=None)
    if grand and peak is not None:
        summary = (f"{format_count(grand)} in all; the most, {format_count(totals[peak])}, "
                   f"at {_span_text(points[peak].at, win)}")
    else:
        summary = empty
    out = _frame(title, summary, points, win, top, format_count)
    n = max(len(points), 1)
    w = PLOT_W / n
    gap = min(2.0, w * 0.2)
    for i, p in enumerate(points):
        base = 0.0
        for s in series:
            v = s.value(p) or 0
            if v <= 0:
                continue
            h = PLOT_H * v / top
            y = TOP + PLOT_H - PLOT_H * base / top - h
            out.append(f'<rect class="{s.css}" x="{LEFT + w * i + gap / 2:.2f}" y="{y:.2f}" '
                       f'width="{max(w - gap, 0.5):.2f}" height="{h:.2f}"/>')
            base += v
    return _finish(out, points, win, lambda p: ", ".join(
        f"{format_count(s.value(p) or 0)} {s.label}" for s in series), None if grand else empty)


def line_chart(title: str, points: Sequence[Point], win: Window, series: Sequence[Series],
               empty: str, durations: bool = False) -> Markup:
    """One line per series; a step without a value breaks the line (a gap, not a zero)."""
    values = [v for s in series for p in points if (v := s.value(p)) is not None]
    top = _nice_ms(max(values, default=0)) if durations else _nice(max(values, default=0), True)
    fmt = format_ms if durations else format_count
    if values:
        last = next((v for p in reversed(points) if (v := series[0].value(p)) is not None), None)
        summary = (f"highest {series[0].label if len(series) == 1 else 'value'} "
                   f"{fmt(max(values))}" +
                   (f"; latest {series[0].label} {fmt(last)}" if last is not None else ""))
    else:
        summary = empty
    out = _frame(title, summary, points, win, top, fmt)
    n = max(len(points), 1)
    for s in series:
        runs: list[list[str]] = [[]]
        for i, p in enumerate(points):
            v = s.value(p)
            if v is None:
                runs.append([])
                continue
            x = LEFT + PLOT_W * (i + 0.5) / n
            y = TOP + PLOT_H - PLOT_H * min(v, top) / top
            runs[-1].append(f"{x:.1f},{y:.1f}")
        for run in runs:
            if len(run) == 1:  # a lone value: a dot, or it would not show at all
                cx, cy = run[0].split(",")
                out.append(f'<circle class="{s.css} dot" cx="{cx}" cy="{cy}" r="2.2"/>')
            elif run:
                out.append(f'<polyline class="{s.css} line" points="{" ".join(run)}"/>')
    return _finish(out, points, win, lambda p: ", ".join(
        f"{s.label} {'–' if (w := s.value(p)) is None else fmt(w)}" for s in series),
        None if values else empty)
