"""Plot a run's TensorBoard scalars as one small, self-contained SVG (no plotting library).

    python scripts/plot_tensorboard.py outputs/debug_2d/tb curves.svg [--tags loss,lr] [--title TEXT]

Reads the event files with TensorBoard's own EventAccumulator and draws one panel per
scalar tag (the trainer's tags first, in the order it logs them), with axes, ticks and
labels. The SVG embeds in markdown and renders on GitHub without TensorBoard running.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

# Tags train.py logs, in its order (training/metrics.py); any others follow, sorted.
KNOWN_TAGS = ("loss", "lr", "grad_norm", "tokens_per_second", "mfu", "peak_gib", "reserved_gib",
              "valley_gib", "rss_gib", "peak_rss_gib")
PANEL_W, PANEL_H, COLUMNS = 340, 190, 2
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 26, 34  # margins inside a panel, around the plot area


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] for every scalar in the event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    tags = acc.Tags()["scalars"]
    ordered = [t for t in KNOWN_TAGS if t in tags] + sorted(t for t in tags if t not in KNOWN_TAGS)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in ordered}


def nice_ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """About ``count`` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        lo, hi = lo - (abs(lo) or 1) * 0.05, hi + (abs(hi) or 1) * 0.05
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.floor(lo / step) * step
    n = math.ceil((hi - first) / step - 1e-9)
    return [first + i * step for i in range(n + 1)]


def label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.3g}"


def panel(tag: str, points: list[tuple[int, float]], x0: float, y0: float) -> list[str]:
    """One plot at (x0, y0): frame, grid, ticks, tick labels, the curve and its title."""
    points = [(s, v) for s, v in points if math.isfinite(v)]  # a skipped inf/NaN step has no place
    out = [f'<g class="panel" data-tag={quoteattr(tag)}>',
           f'<text x="{x0 + PANEL_W / 2:.1f}" y="{y0 + 16}" text-anchor="middle" '
           f'font-weight="bold">{escape(tag)}</text>']
    if not points:
        return out + [f'<text x="{x0 + PANEL_W / 2:.1f}" y="{y0 + PANEL_H / 2}" '
                      'text-anchor="middle">no finite values</text>', "</g>"]
    steps, values = [s for s, _ in points], [v for _, v in points]
    xt, yt = nice_ticks(min(steps), max(steps)), nice_ticks(min(values), max(values))
    left, right = x0 + LEFT, x0 + PANEL_W - RIGHT
    top, bottom = y0 + TOP, y0 + PANEL_H - BOTTOM

    def px(s):
        return left + (s - xt[0]) / (xt[-1] - xt[0]) * (right - left)

    def py(v):
        return bottom - (v - yt[0]) / (yt[-1] - yt[0]) * (bottom - top)

    for v in yt:
        out.append(f'<line x1="{left}" x2="{right}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{left - 5}" y="{py(v) + 4:.1f}" text-anchor="end">{label(v)}</text>')
    for s in xt:
        out.append(f'<line x1="{px(s):.1f}" x2="{px(s):.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#444"/>')
        out.append(f'<text x="{px(s):.1f}" y="{bottom + 16}" text-anchor="middle">{label(s)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
               'fill="none" stroke="#444"/>')
    out.append(f'<text x="{(left + right) / 2:.1f}" y="{bottom + 29}" text-anchor="middle" '
               'fill="#666">step</text>')
    curve = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in points)
    out += [f'<polyline points="{curve}" fill="none" stroke="#d9480f" stroke-width="1.5"/>', "</g>"]
    return out


def render_svg(scalars: dict[str, list[tuple[int, float]]], title: str = "") -> str:
    rows = math.ceil(len(scalars) / COLUMNS)
    head = 28 if title else 0
    width, height = COLUMNS * PANEL_W, rows * PANEL_H + head
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    if title:
        out.append(f'<text x="{width / 2}" y="19" text-anchor="middle" font-size="14">{escape(title)}</text>')
    for i, (tag, points) in enumerate(scalars.items()):
        out += panel(tag, points, (i % COLUMNS) * PANEL_W, head + (i // COLUMNS) * PANEL_H)
    return "\n".join(out + ["</svg>"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/plot_tensorboard.py", description=__doc__.split("\n\n")[0])
    p.add_argument("log_dir", help="a folder of TensorBoard event files, e.g. outputs/debug_2d/tb")
    p.add_argument("out", help="the SVG file to write")
    p.add_argument("--tags", help="comma-separated scalar tags to plot (default: all)")
    p.add_argument("--title", help="heading (default: the run's folder name)")
    args = p.parse_args(argv)
    scalars = read_scalars(args.log_dir)
    if args.tags:
        wanted = [t.strip() for t in args.tags.split(",") if t.strip()]
        missing = [t for t in wanted if t not in scalars]
        if missing:
            p.error(f"no scalar tag {', '.join(missing)} in {args.log_dir}; found: {', '.join(scalars) or 'none'}")
        scalars = {t: scalars[t] for t in wanted}
    if not scalars:
        p.error(f"no scalars in {args.log_dir} (is it the folder holding events.out.tfevents.* files?)")
    log_dir = Path(args.log_dir).resolve()
    title = args.title if args.title is not None else (log_dir.parent if log_dir.name == "tb" else log_dir).name
    Path(args.out).write_text(render_svg(scalars, title), encoding="utf-8")
    print(f"wrote {args.out}: {', '.join(f'{t} ({len(v)} points)' for t, v in scalars.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
