"""A stacked-bar PNG of a memory plan: one bar per pipeline stage (plan) or per layout (search).

Each bar stacks the breakdown lines of parallel/plan/memory.py (worst rank of the stage or layout);
the dashed line is the device memory. `draw` returns the bar totals it drew, in GiB, so a test can
compare the picture with the report.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from parallel.plan.memory import LINES

GIB = 2**30


def _bars(report: dict) -> tuple[list[str], list[dict]]:
    if report["mode"] == "plan":
        return [f"stage {s['stage']}" for s in report["stages"]], [s["lines"] for s in report["stages"]]
    shown = report["ranked"] or report["not_fitting"]
    labels = [f"tp{c['tp']}{' sp' + str(c['sp']) if c.get('sp', 1) > 1 else ''} pp{c['pp']} dp{c['dp']}\nZeRO-{c['zero']}{' ckpt' if c['checkpointing'] else ''}"
              f" mb{c['micro_batch']}" for c in shown]
    return labels, [c["memory"]["lines"] for c in shown]


def draw(report: dict, path: str) -> list[float]:
    labels, breakdowns = _bars(report)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels) + 3), 5))
    bottoms = [0.0] * len(labels)
    for key, name in LINES:
        heights = [b.get(key, 0) / GIB for b in breakdowns]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, label=name)
            bottoms = [x + h for x, h in zip(bottoms, heights)]
    memory = report["device"]["memory"] / GIB
    ax.axhline(memory, color="black", linestyle="--", linewidth=1, label=f"device memory {memory:.0f} GiB")
    model = report["model"]
    ax.set_title(f"{model.get('name', 'model')}: per-rank memory, worst rank "
                 f"({'pipeline stages' if report['mode'] == 'plan' else 'fitting layouts, fastest first'})")
    ax.set_ylabel("GiB")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return bottoms
