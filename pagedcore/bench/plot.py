"""`pagedcore bench plot`: one PNG from the throughput JSON and, optionally, the serve JSON.

Panels: offline output tok/s per engine; single-stream time per output token per engine; with a serve
JSON, TTFT and end-to-end latency (p50, p99) per front door. Skipped peers stay on the axis as a
labelled gap, with their reasons under the figure, so a missing bar is never mistaken for a slow one.
"""

from __future__ import annotations

import sys
import textwrap

from pagedcore.bench.report import load_json

OURS, PEER, SKIPPED = "#c0392b", "#8c8c8c", "#bbbbbb"
SERVE_BARS = [("ttft_ms", "p50", "TTFT p50"), ("ttft_ms", "p99", "TTFT p99"),
              ("e2e_ms", "p50", "E2E p50"), ("e2e_ms", "p99", "E2E p99")]
SERVE_COLORS = ["#2e86c1", "#85c1e9", "#239b56", "#82e0aa"]


def _label(engine: str) -> str:
    return textwrap.fill(engine, 18)


def _is_ours(row: dict) -> bool:
    return row.get("peer", row["engine"]) == "pagedcore"


def _bars(ax, rows: list[dict], value, text, ylabel: str, title: str) -> list[str]:
    """One bar per row, pagedcore highlighted; skipped rows are labelled gaps. Returns skip notes."""
    notes = []
    top = max([value(r) for r in rows if "skipped" not in r] or [1.0])
    for x, r in enumerate(rows):
        if "skipped" in r:
            ax.bar(x, 0, color=SKIPPED)
            ax.text(x, top * 0.02, "skipped", rotation=90, ha="center", va="bottom", color="#666666", fontsize=8)
            notes.append(f"{r['engine']}: {r['skipped']}")
            continue
        v = value(r)
        ax.bar(x, v, color=OURS if _is_ours(r) else PEER)
        ax.text(x, v, text(r, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [_label(r["engine"]) for r in rows], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, top * 1.15)
    return notes


def _throughput_panel(ax, throughput: dict) -> list[str]:
    ratios = throughput.get("ratios", {})

    def text(r, v):  # each measured peer also says how many times faster pagedcore was
        ratio = ratios.get(r.get("peer"))
        return f"{v:.1f}" if ratio is None else f"{v:.1f}\npagedcore {ratio:.2f}x"

    return _bars(ax, throughput["results"], lambda r: r["output_tok_s"], text, "output tokens / s",
                 "offline throughput (higher is better)")


def _single_stream_panel(ax, throughput: dict) -> list[str]:
    rows = throughput.get("single_stream") or []
    if not rows:
        ax.text(0.5, 0.5, "no single-stream data", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return []
    notes = _bars(ax, rows, lambda r: r["tpot_s"] * 1e3, lambda r, v: f"{v:.1f}", "ms / output token",
                  "single-stream TPOT (lower is better)")
    return [f"single stream {n}" for n in notes]


def _serve_panel(ax, serve: dict) -> None:
    rows = serve.get("results", [])
    width = 0.8 / len(SERVE_BARS)
    for i, (metric, pct, name) in enumerate(SERVE_BARS):
        xs = [x + (i - 1.5) * width for x in range(len(rows))]
        values = [r.get(metric, {}).get(pct, 0) for r in rows]
        ax.bar(xs, values, width, label=name, color=SERVE_COLORS[i])
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=6)
    labels = [_label(f"{r['frontend']} @ {r.get('request_rate', 0):g} req/s") for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("ms")
    ax.set_yscale("log")  # TTFT and E2E differ by orders of magnitude
    ax.set_title("serving latency (lower is better)", fontsize=10)
    ax.legend(fontsize=7)


def _subtitle(throughput: dict) -> str:
    parts = [throughput.get("model", ""), throughput.get("dtype", "")]
    w = throughput.get("workload")
    if w:
        parts.append(f"{w['num_prompts']} prompts, in {w['input_len'][0]}-{w['input_len'][1]}, "
                     f"out {w['output_len'][0]}-{w['output_len'][1]} tokens")
    m = throughput.get("machine")
    if isinstance(m, dict):
        parts.append(f"{m.get('cpu', '')}, {m.get('threads', '?')} threads")
    return "; ".join(p for p in parts if p)


def plot(throughput: dict, serve: dict | None, out_path) -> None:
    """Write the PNG. Uses matplotlib's object API on the Agg canvas: no pyplot, no global backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = 3 if serve else 2
    fig = Figure(figsize=(5 * ncols, 5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    notes = _throughput_panel(axes[0], throughput) + _single_stream_panel(axes[1], throughput)
    if serve:
        _serve_panel(axes[2], serve)
    fig.suptitle(f"pagedcore benchmarks\n{_subtitle(throughput)}", fontsize=10)
    if notes:
        fig.supxlabel("\n".join(textwrap.shorten("skipped: " + n, 160) for n in notes), fontsize=7, ha="left", x=0.01)
    fig.savefig(out_path, dpi=120)


def main(args) -> int:
    plot(load_json(args.throughput), load_json(args.serve), args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def add_parser(bsub) -> None:
    p = bsub.add_parser("plot", help="PNG of throughput (and serve) results")
    p.add_argument("--throughput", required=True, help="JSON from `pagedcore bench throughput`")
    p.add_argument("--serve", default=None, help="JSON from `pagedcore bench serve`")
    p.add_argument("--out", required=True, help="PNG path")
    p.set_defaults(func=main)
