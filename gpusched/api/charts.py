"""The console's charts: server-rendered SVG with axes, units and a legend, and nothing else (no
script, no library, nothing fetched). Three kinds over time: ``line`` (a gap where a value is
None), ``area`` (series stacked, None counts as 0) and ``bars`` (stacked per bucket)
(:func:`time_chart`); one horizontal bar per queue and flavor for the Queues page
(:func:`quota_bars`); and the occupancy map, a square per GPU (:func:`occupancy_map`).

Markup is built only with ``Markup.format``, which escapes every value it puts in: a team or
flavor name in a legend is text, never markup. Colours are a function of the name alone
(:func:`colour`), so a team has one colour on every page and after every refresh."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from markupsafe import Markup

FREE = "#eaecf0"
"""A free GPU's colour (the occupancy map's, and unused quota's)."""
OTHERS = "#98a2b3"
"""Held by another team (what a member sees of other teams' GPUs)."""
WIDTH, HEIGHT = 640, 190
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 22, 24  # the plot's margins: tick labels left and below, the unit above
LEGEND_ROW, LEGEND_ITEM = 18, 170

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#d37295")
"""Tableau's ten colours (the last, grey, swapped for one that is not mistaken for free or other teams)."""


def colour(name: str) -> str:
    """A colour for ``name`` that depends on nothing else (the name's CRC-32 picks one of
    :data:`PALETTE`), so a team or flavor keeps its colour whatever else is shown; two names
    may share one (ten colours), which the legend and each cell's title tell apart."""
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


@dataclass(frozen=True)
class Series:
    name: str
    values: Sequence[float | int | None]
    colour: str = ""  # default: colour(name)
    dashed: bool = False  # a line's second figure in the same colour (a p90 beside its p50)


def fmt_number(x: float) -> str:
    """Tick labels: whole numbers with thousands separators, else at most two decimals (2.5, 0.25)."""
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:.2f}".rstrip("0").rstrip(".") if abs(x) < 10 else f"{x:,.0f}"


def fmt_duration(seconds: float) -> str:
    """Seconds as a person reads them on an axis: 45 s, 12 min, 3.5 h, 2 d."""
    for unit, size in (("d", 86_400), ("h", 3600), ("min", 60)):
        if abs(seconds) >= size:
            return f"{round(seconds / size, 1):g} {unit}"
    return f"{round(seconds, 1):g} s"


def nice_step(top: float, ticks: int = 5) -> float:
    """A step of 1, 2 or 5 × 10^k giving at most ``ticks`` steps from 0 to ``top``."""
    raw = max(top, 1e-9) / ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw * (1 - 1e-9))



def count_step(top: float) -> float:
    """:func:`nice_step` for things counted whole (attempts, jobs, GPUs): at least 1."""
    return max(1.0, nice_step(top))


DURATION_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10_800, 21_600, 43_200, 86_400)


def nice_duration_step(top: float, ticks: int = 4) -> float:
    """:func:`nice_step` for seconds: a step a clock has (30 s, 5 min, 2 h, 1 d, then whole days)."""
    raw = max(top, 1e-9) / ticks
    return next((float(s) for s in DURATION_STEPS if s >= raw), math.ceil(raw / 86_400) * 86_400.0)


TIME_STEPS = [timedelta(minutes=m) for m in (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440, 2880)]


def time_ticks(first: datetime, last: datetime, most: int = 8) -> list[datetime]:
    """Round times (multiples of a step from the epoch) between ``first`` and ``last``, at most ``most``."""
    span = (last - first).total_seconds()
    step = next((s for s in TIME_STEPS if span / s.total_seconds() <= most - 1), TIME_STEPS[-1])
    size = step.total_seconds()
    t = math.ceil(first.timestamp() / size) * size
    out = []
    while t <= last.timestamp():
        out.append(datetime.fromtimestamp(t, UTC))
        t += size
    return out


def _time_label(t: datetime, span: timedelta) -> str:
    return t.strftime("%H:%M") if span <= timedelta(days=1) else t.strftime("%a %H:%M")


def time_chart(times: Sequence[datetime], series: Sequence[Series], unit: str, *, kind: str = "line",
               fmt: Callable[[float], str] = fmt_number, step_of: Callable[[float], float] = nice_step,
               top: float | None = None, join_gaps: bool = False,
               width: int = WIDTH, height: int = HEIGHT) -> Markup:
    """A chart of ``series`` (one value per time in ``times``; times ascending, in UTC) with a
    y axis in ``unit`` (ticks every ``step_of(top)``, labelled by ``fmt``; ``top``: a fixed
    maximum such as 100 %), a time axis, and a legend naming each series in its colour.
    ``kind``: line, area or bars. Each bucket's value sits at its middle (a bar fills it).
    A line breaks where a value is None, unless ``join_gaps`` (figures sampled more coarsely
    than the buckets, such as telemetry windows: an empty bucket is no sample, not a gap)."""
    if kind not in ("line", "area", "bars"):
        raise ValueError(f"kind {kind!r}: accepted: line, area, bars")
    for s in series:
        if len(s.values) != len(times):
            raise ValueError(f"series {s.name!r}: {len(s.values)} values for {len(times)} times")
    plot_w, plot_h = width - LEFT - RIGHT, height - TOP - BOTTOM
    stacked = kind != "line"
    lows, highs = _stack(series, len(times)) if stacked else (None, None)
    known = [v for row in (highs or [[x for x in s.values if x is not None] for s in series]) for v in row
             if v is not None]
    top = top or max(known, default=0.0) or 1.0
    step = step_of(top)
    top = math.ceil(top / step - 1e-9) * step
    n = len(times)
    slot = plot_w / max(1, n)  # a bar's width; lines and areas put a bucket's value at its middle

    def x(i: float) -> float:
        return LEFT + (i + 0.5) * slot

    def y(v: float) -> float:
        return TOP + plot_h - v / top * plot_h

    parts = [_y_axis(top, step, fmt, unit, plot_w, plot_h)]
    if n:
        parts.append(_x_axis(times, slot, plot_h))
    for k, s in enumerate(series):
        c = s.colour or colour(s.name)
        if kind == "line":
            parts.append(_line(s, c, x, y, join_gaps))
        elif kind == "area":
            parts.append(_area(s.name, lows[k], highs[k], c, x, y))
        else:
            parts.append(_bars(s.name, lows[k], highs[k], c, x, y, slot))
    if not known or not any(known):
        parts.append(Markup('<text class="empty" x="{}" y="{}" text-anchor="middle">no data in this window</text>')
                     .format(LEFT + plot_w / 2, TOP + plot_h / 2))
    legend, legend_h = _legend([(s.name, s.colour or colour(s.name), kind == "line", s.dashed) for s in series],
                               height, width)
    parts.append(legend)
    return Markup('<svg class="chart-svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
                  'data-unit="{unit}">{body}</svg>').format(w=width, h=height + legend_h, unit=unit,
                                                            body=Markup("").join(parts))


def _stack(series: Sequence[Series], n: int) -> tuple[list[list[float]], list[list[float]]]:
    """Each series' lower and upper edge when stacked in order (None counts as 0)."""
    base = [0.0] * n
    lows, highs = [], []
    for s in series:
        low = list(base)
        base = [b + float(v or 0) for b, v in zip(base, s.values)]
        lows.append(low)
        highs.append(list(base))
    return lows, highs


def _y_axis(top: float, step: float, fmt: Callable[[float], str], unit: str, plot_w: float, plot_h: float) -> Markup:
    out = [Markup('<text class="unit" x="{}" y="12">{}</text>').format(4, unit)]
    for i in range(round(top / step) + 1):
        v = i * step
        yy = TOP + plot_h - v / top * plot_h
        out.append(Markup('<line class="grid" x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}"/>'
                          '<text class="tick y-tick" x="{tx}" y="{ty:.1f}" text-anchor="end">{label}</text>')
                   .format(x0=LEFT, x1=LEFT + plot_w, y=yy, tx=LEFT - 5, ty=yy + 4, label=fmt(v)))
    return Markup("").join(out)


def _x_axis(times: Sequence[datetime], slot: float, plot_h: float) -> Markup:
    first, last = times[0], times[-1]
    span = last - first
    bucket = (times[1] - times[0]) if len(times) > 1 else timedelta(0)
    out = [Markup('<line class="axis" x1="{x0}" y1="{y}" x2="{x1}" y2="{y}"/>')
           .format(x0=LEFT, x1=LEFT + slot * len(times), y=TOP + plot_h)]
    for t in time_ticks(first, last + bucket):
        offset = (t - first) / bucket if bucket else 0.0  # in buckets from the first bucket's start
        xx = LEFT + offset * slot
        out.append(Markup('<line class="axis" x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y1}"/>'
                          '<text class="tick x-tick" x="{x:.1f}" y="{ty}" text-anchor="middle">{label}</text>')
                   .format(x=xx, y0=TOP + plot_h, y1=TOP + plot_h + 4, ty=TOP + plot_h + 16,
                           label=_time_label(t, span)))
    return Markup("").join(out)


def _line(s: Series, c: str, x: Callable[[float], float], y: Callable[[float], float], join_gaps: bool) -> Markup:
    """One path per series, a new subpath after each gap; a point alone is a dot."""
    runs: list[list[tuple[float, float]]] = [[]]
    for i, v in enumerate(s.values):
        if v is None:
            if not join_gaps:
                runs.append([])
        else:
            runs[-1].append((x(i), y(float(v))))
    runs = [r for r in runs if r]
    d = " ".join("M" + " L".join(f"{px:.1f},{py:.1f}" for px, py in r) for r in runs if len(r) > 1)
    out = [Markup('<path class="series line" data-series="{n}" fill="none" stroke="{c}" stroke-width="2" '
                  'stroke-dasharray="{dash}" d="{d}"/>').format(n=s.name, c=c, d=d, dash="5 3" if s.dashed else "none")
           ] if d else []
    out += [Markup('<circle class="series dot" data-series="{n}" fill="{c}" r="3" cx="{x:.1f}" cy="{y:.1f}"/>')
            .format(n=s.name, c=c, x=r[0][0], y=r[0][1]) for r in runs if len(r) == 1]
    return Markup("").join(out)


def _area(name: str, low: list[float], high: list[float], c: str, x: Callable[[float], float],
          y: Callable[[float], float]) -> Markup:
    if not any(h > lo for h, lo in zip(high, low)):
        return Markup("")
    top_edge = [f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(high)]
    bottom_edge = [f"{x(i):.1f},{y(v):.1f}" for i, v in reversed(list(enumerate(low)))]
    d = "M" + " L".join(top_edge + bottom_edge) + " Z"
    return Markup('<path class="series area" data-series="{n}" fill="{c}" fill-opacity="0.8" stroke="{c}" d="{d}"/>'
                  ).format(n=name, c=c, d=d)


def _bars(name: str, low: list[float], high: list[float], c: str, x: Callable[[float], float],
          y: Callable[[float], float], slot: float) -> Markup:
    w = max(1.0, slot * 0.8)
    return Markup("").join(
        Markup('<rect class="series bar" data-series="{n}" fill="{c}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
               'height="{h:.1f}"/>').format(n=name, c=c, x=x(i) - w / 2, y=y(hi), w=w, h=y(lo) - y(hi))
        for i, (lo, hi) in enumerate(zip(low, high)) if hi > lo)


def _legend(items: Sequence[tuple[str, str, bool, bool]], y0: float, width: int) -> tuple[Markup, int]:
    """The legend under the plot: a swatch (a line's: a stroke, dashed or not) and the name of
    each series, from (name, colour, line, dashed); (markup, its height)."""
    per_row = max(1, (width - LEFT) // LEGEND_ITEM)
    out = []
    for i, (name, c, line, dashed) in enumerate(items):
        row, col = divmod(i, per_row)
        lx, ly = LEFT + col * LEGEND_ITEM, y0 + 4 + row * LEGEND_ROW
        swatch = (Markup('<line x1="{x}" y1="{y}" x2="{x2}" y2="{y}" stroke="{c}" stroke-width="2" '
                         'stroke-dasharray="{dash}"/>').format(x=lx, x2=lx + 14, y=ly + 6, c=c,
                                                                dash="4 2" if dashed else "none") if line
                  else Markup('<rect x="{x}" y="{y}" width="12" height="12" fill="{c}"/>').format(x=lx, y=ly, c=c))
        out.append(Markup('{swatch}<text x="{tx}" y="{ty}">{name}</text>').format(swatch=swatch, tx=lx + 19,
                                                                                 ty=ly + 11, name=name))
    rows = math.ceil(len(items) / per_row)
    return Markup('<g class="legend">{}</g>').format(Markup("").join(out)), rows * LEGEND_ROW + 6


QUOTA_PARTS = (("guaranteed in use", "#2d5bd7"), ("borrowed", "#f79009"), ("lent to others", "#84adff"),
               ("unused nominal", FREE))
"""The Queues bars' segments, in order: used within the nominal quota, used above it (borrowed from
the cohort), the part of the nominal quota other queues use (lent), and the rest of the nominal."""


def quota_bars(rows: Sequence[dict], width: int = WIDTH) -> Markup:
    """One horizontal bar per queue and flavor (rows as the Queues table's: queue, flavor,
    nominal, used, borrowed, lent, in GPUs) on one scale, with a tick at each nominal quota."""
    label_w, bar_h, gap = 170, 16, 8
    plot_w = width - label_w - RIGHT - 40
    scale_top = max([_bar_end(r) for r in rows] + [1.0])
    step = count_step(scale_top)
    scale_top = math.ceil(scale_top / step - 1e-9) * step

    def px(v: float) -> float:
        return v / scale_top * plot_w

    out = []
    for i, r in enumerate(rows):
        nominal, used = float(r["nominal"] or 0), float(r["used"] or 0)
        borrowed, lent = float(r["borrowed"] or 0), float(r["lent"] or 0)
        guaranteed = max(0.0, used - borrowed)
        parts = (guaranteed, borrowed, lent, max(0.0, nominal - guaranteed - lent))
        yy = TOP + i * (bar_h + gap)
        out.append(Markup('<text class="bar-label" x="{x}" y="{y}" text-anchor="end">{q} · {f}</text>')
                   .format(x=label_w - 6, y=yy + 12, q=r["queue"], f=r["flavor"]))
        xx = float(label_w)
        for (name, c), v in zip(QUOTA_PARTS, parts):
            if v > 0:
                out.append(Markup('<rect class="series quota" data-part="{n}" data-queue="{q}" fill="{c}" x="{x:.1f}" '
                                  'y="{y}" width="{w:.1f}" height="{h}"><title>{q} {f}: {n} {v} GPUs</title></rect>')
                           .format(n=name, q=r["queue"], f=r["flavor"], c=c, x=xx, y=yy, w=px(v), h=bar_h,
                                   v=fmt_number(v)))
                xx += px(v)
        end = max(xx, label_w + px(nominal))
        out.append(Markup('<line class="nominal" x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y1}"/>'
                          '<text class="tick" x="{tx:.1f}" y="{ty}">{used} used · nominal {nominal}</text>')
                   .format(x=label_w + px(nominal), y0=yy - 3, y1=yy + bar_h + 3, tx=end + 6, ty=yy + 12,
                           used=fmt_number(used), nominal=fmt_number(nominal)))
    axis_y = TOP + len(rows) * (bar_h + gap)
    ticks = [Markup('<line class="axis" x1="{x0}" y1="{y}" x2="{x1}" y2="{y}"/>').format(
        x0=label_w, x1=label_w + plot_w, y=axis_y)]
    for k in range(round(scale_top / step) + 1):
        v = k * step
        ticks.append(Markup('<text class="tick x-tick" x="{x:.1f}" y="{y}" text-anchor="middle">{label}</text>')
                     .format(x=label_w + px(v), y=axis_y + 14, label=fmt_number(v)))
    height = axis_y + 22
    legend, legend_h = _legend([(n, c, False, False) for n, c in QUOTA_PARTS] + [("nominal quota", "#1d2330", True,
                                                                                   False)], height, width)
    return Markup('<svg class="chart-svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" data-unit="GPUs">'
                  '<text class="unit" x="4" y="12">GPUs</text>{body}{ticks}{legend}</svg>').format(
        w=width, h=height + legend_h, body=Markup("").join(out), ticks=Markup("").join(ticks), legend=legend)


def _bar_end(r: dict) -> float:
    """Where a queue's bar ends: its nominal quota (or more, what it uses of it and lends) plus what it borrows."""
    guaranteed = max(0.0, float(r["used"] or 0) - float(r["borrowed"] or 0))
    return max(float(r["nominal"] or 0), guaranteed + float(r["lent"] or 0)) + float(r["borrowed"] or 0)


@dataclass(frozen=True)
class Cell:
    """One GPU of the occupancy map: who holds it, as (team, fraction) parts (none: free)."""

    parts: tuple[tuple[str, float], ...] = ()

    @property
    def free(self) -> float:
        return max(0.0, 1.0 - sum(f for _, f in self.parts))


def gpu_cells(gpu_count: int, holders: Sequence[dict]) -> list[Cell]:
    """A node's GPUs as cells from what its placed attempts hold (``holders``: team, gpus,
    gpu_milli, as :func:`services.accounting.queries.gpu_holders`): whole GPUs first, one cell
    each, then each share of a GPU in the first shared cell it fits in (else the next free one).
    The read models do not say which device index a job holds, so cells are packed in that order."""
    cells: list[list[tuple[str, float]]] = [[] for _ in range(gpu_count)]
    nxt = 0
    for h in holders:
        if h["gpu_milli"] is None:
            for _ in range(h["gpus"] or 0):
                if nxt < gpu_count:
                    cells[nxt] = [(h["team"], 1.0)]
                    nxt += 1
    for h in holders:
        if h["gpu_milli"] is not None:
            share = h["gpu_milli"] / 1000
            for _ in range(max(1, h["gpus"] or 0)):
                fits = [i for i in range(gpu_count) if cells[i] and sum(f for _, f in cells[i]) + share <= 1.0 + 1e-9
                        and all(f < 1.0 for _, f in cells[i])]
                if fits:
                    cells[fits[0]].append((h["team"], share))
                elif nxt < gpu_count:
                    cells[nxt] = [(h["team"], share)]
                    nxt += 1
    return [Cell(tuple(c)) for c in cells]


def occupancy_map(nodes: Sequence[dict], holders: Sequence[dict], team: str | None = None) -> list[dict]:
    """Per flavor: its nodes (from :func:`services.accounting.queries.nodes`), each with its
    cells (:func:`gpu_cells`), and the map's SVG. ``team``: a member's, whose GPUs are shown by
    team and every other team's as "other teams" (as the API names no other team's jobs)."""
    by_node: dict[str, list[dict]] = {}
    for h in holders:
        name = h["team"] if team is None or h["team"] == team else "other teams"
        by_node.setdefault(h["node"], []).append({**h, "team": name})
    flavors: dict[str, list[dict]] = {}
    for n in nodes:
        flavors.setdefault(n["gpu_flavor"] or "-", []).append(
            {**n, "cells": gpu_cells(n["gpu_count"], by_node.get(n["name"], []))})
    return [{"flavor": f, "nodes": flavors[f], "svg": _occupancy_svg(f, flavors[f])} for f in sorted(flavors)]


def _cell_colour(name: str) -> str:
    return OTHERS if name == "other teams" else colour(name)


def _occupancy_svg(flavor: str, nodes: Sequence[dict], size: int = 26, gap: int = 4) -> Markup:
    label_w = 110
    width = label_w + max(n["gpu_count"] for n in nodes) * (size + gap) + 90
    rows = []
    for r, n in enumerate(nodes):
        y = r * (size + gap) + 2
        state = "lost" if n["lost"] else "cordoned" if n["unschedulable"] else "ready"
        cells = []
        for i, cell in enumerate(n["cells"]):
            x = label_w + i * (size + gap)
            parts, px = [], float(x)
            for name, fraction in cell.parts:  # a shared GPU: one slice per job, width by its share
                parts.append(Markup('<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{s}" fill="{c}"/>')
                             .format(x=px, y=y, w=size * fraction, s=size, c=_cell_colour(name)))
                px += size * fraction
            who = ", ".join(f"{name} {fmt_number(round(fraction, 3))}" for name, fraction in cell.parts) or "free"
            cells.append(Markup('<g class="gpu" data-node="{node}" data-gpu="{i}" data-free="{free}">'
                                '<title>{node} GPU {i}: {who}</title>'
                                '<rect x="{x}" y="{y}" width="{s}" height="{s}" fill="{bg}" class="cell {state}"/>'
                                '{parts}<rect x="{x}" y="{y}" width="{s}" height="{s}" fill="none" class="edge"/></g>')
                         .format(node=n["name"], i=i, free=fmt_number(round(cell.free, 3)), who=who, x=x, y=y, s=size,
                                 bg=FREE, state=state, parts=Markup("").join(parts)))
        free = sum(c.free for c in n["cells"]) if state == "ready" else 0
        rows.append(Markup('<g class="node" data-node="{node}" data-state="{state}">'
                           '<text x="0" y="{ty}">{node}</text>{cells}'
                           '<text class="note" x="{nx}" y="{ty}">{note}</text></g>')
                    .format(node=n["name"], state=state, ty=y + size * 0.65, cells=Markup("").join(cells),
                            nx=label_w + n["gpu_count"] * (size + gap) + 4,
                            note=state if state != "ready" else f"{fmt_number(round(free, 3))} free"))
    height = len(nodes) * (size + gap) + 4
    return Markup('<svg class="occupancy-svg" data-flavor="{f}" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
                  'role="img">{rows}</svg>').format(f=flavor, w=width, h=height, rows=Markup("").join(rows))


def team_legend(names: Sequence[str]) -> Markup:
    """The occupancy map's legend: each team's colour, then free (SVG swatches: the pages'
    Content-Security-Policy allows no style attribute)."""
    items = [(n, _cell_colour(n)) for n in names] + [("free", FREE)]
    return Markup('<ul class="legend-list">{}</ul>').format(Markup("").join(
        Markup('<li><svg class="swatch" width="12" height="12"><rect width="12" height="12" fill="{c}"/></svg>{n}</li>')
        .format(c=c, n=n) for n, c in items))
