"""What a run of scripts/bench_suite.py says: each model's ratios against the goals of issue 30 (round by round and
their medians), the docs page (performance-suite.md) and its chart (img/suite.png)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEERS = ("kserve", "mlserver")
# ratio -> (label, goal, at least?)
GOALS = {
    "top_vs_inprocess": ("servex rows/s at top callers / in-process limit", 0.9, True),
    "top_vs_peer": ("servex rows/s at top callers / better peer", 1.2, True),
    "lat_vs_inprocess": ("servex 1-caller mean latency / in-process batch-1", 1.05, False),
    "lat_vs_peer": ("servex 1-caller mean latency / better peer's (mlp: KServe's)", 1.0, False),
    "p99_vs_p50": ("servex p99 / p50 at top callers", 2.0, False),
    # The 1-caller latencies through grpcio's client as well as h2load (docs/performance.md: h2load's waits)
    "grpc_lat_vs_inprocess": ("servex 1-caller mean latency, grpcio client / in-process batch-1", 1.05, False),
    "grpc_lat_vs_peer": ("servex 1-caller mean latency, grpcio client / better peer's (mlp: KServe's)", 1.0, False),
}
MLP_GOALS = {"top_vs_peer": 3.0, "lat_vs_peer": 0.7}


def ratios(d: dict, model: str, top: int, one: int) -> dict[str, float | None]:
    """servex against in-process TensorFlow and the better peer, for one model in one round."""
    ok = lambda s: s in d and "error" not in d[s]  # noqa: E731
    sx = d["servex"]["levels"] if ok("servex") else None
    inproc = d.get("inprocess") if ok("inprocess") else None
    peers = [d[p]["levels"] for p in PEERS if ok(p)]
    lat_peers = [d[p] for p in (("kserve",) if model == "mlp" else PEERS) if ok(p)]
    div = lambda x, y: round(x / y, 3) if x is not None and y else None  # noqa: E731
    if sx is None:
        return dict.fromkeys(GOALS)
    grpc_ms = d["servex"].get("grpc_one_ms")
    return {
        "top_vs_inprocess": div(sx[top]["rows_s"], inproc and inproc["limit_rows_s"]),
        "top_vs_peer": div(sx[top]["rows_s"], max((p[top]["rows_s"] for p in peers), default=None)),
        "lat_vs_inprocess": div(sx[one]["mean_ms"], inproc and inproc["latency_ms"]),
        "lat_vs_peer": div(sx[one]["mean_ms"], min((p["levels"][one]["mean_ms"] for p in lat_peers), default=None)),
        "p99_vs_p50": div(sx[top]["p99_ms"], sx[top]["p50_ms"]),
        "grpc_lat_vs_inprocess": div(grpc_ms, inproc and inproc["latency_ms"]),
        "grpc_lat_vs_peer": div(
            grpc_ms, min((p["grpc_one_ms"] for p in lat_peers if p.get("grpc_one_ms")), default=None)
        ),
    }


def verdict(model: str, key: str, s: dict, goals: bool = True) -> str:
    """The median ratio (and each round's, where there were several), against its goal unless ``goals`` is false
    (the docs page shows the figures only)."""
    value, (_, goal, at_least) = s["ratios"][key], GOALS[key]
    if value is None:
        return "n/a"
    goal = MLP_GOALS.get(key, goal) if model == "mlp" else goal
    met = value >= goal if at_least else value <= goal
    by_round = ", ".join("n/a" if r[key] is None else f"{r[key]:.2f}" for r in s["by_round"])
    rounds = f" (rounds: {by_round})" if len(s["by_round"]) > 1 else ""
    if not goals:
        return f"{value:.2f}x{rounds}"
    return f"{value:.2f}x {'met' if met else 'MISSED'} ({'>=' if at_least else '<='} {goal}x){rounds}"


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(rounds: list[dict], models: list[str], top: int, one: int) -> dict[str, dict]:
    """Per model: the median of each figure and ratio over the rounds, the ratios of each round, and the errors."""
    out = {}
    for model in models:
        per_round = [ratios(r.get(model, {}), model, top, one) for r in rounds]
        servers = sorted({s for r in rounds for s in r.get(model, {})}, key=["inprocess", "servex", *PEERS].index)
        figures, errors = {}, {}
        for s in servers:
            runs = [r[model][s] for r in rounds if s in r.get(model, {})]
            errors[s] = sorted({run["error"] for run in runs if "error" in run})
            good = [run for run in runs if "error" not in run]
            if not good:
                continue
            if s == "inprocess":
                figures[s] = {k: median(run[k] for run in good) for k in ("latency_ms", "limit_rows_s")}
                figures[s]["limit_batch"] = statistics.mode(run["limit_batch"] for run in good)
            else:
                levels = good[0]["levels"]
                figures[s] = {c: {k: median(run["levels"][c][k] for run in good) for k in levels[c]} for c in levels}
                figures[s]["grpc_one_ms"] = median(run.get("grpc_one_ms") for run in good)
        medians = {k: median(r[k] for r in per_round) for k in GOALS}
        out[model] = {"figures": figures, "ratios": medians, "by_round": per_round, "errors": errors}
    return out


def markdown(summary: dict, levels: list[int], a, elapsed: float) -> str:
    top, one = levels[-1], levels[0]
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")  # fmt: skip
    tree = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    lines = [
        "# servex on the model suite", "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- machine: {os.cpu_count()} CPUs ({cpu}); date: {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; "
        f"run took {elapsed / 60:.0f} min",
        f"- servex: the working tree at `{tree.stdout.strip()}`, flags: default"
        + (f" plus `{' '.join(a.servex_flag)}`" if a.servex_flag else ""),
        f"- {a.rounds} round(s) of {a.seconds} s per measurement (more for slow models at many callers: ~8"
        " requests per caller); figures and ratios are medians over rounds.",
        "- Servers: KServe v2 ModelInfer through h2load (p50/p99 from its per-request log), and at 1 caller also"
        " through grpcio's client (grpc.aio, the request serialized once); wide_deep_classify:"
        " TensorFlow Serving Classify (one serialized tf.Example a request), the same way.",
        "- Requests carry one row (batch 1); rows/s of the servers is requests/s. In-process: mean batch-1 latency,"
        " and the limit: the best rows/s over batches of 1..32, each batch's median over 3 passes in turns (the batch"
        " that gave it in brackets).",
        "", "## Ratios", "",
        "| model | " + " | ".join(label for label, _, _ in GOALS.values()) + " |",
        "| --- " * (len(GOALS) + 1) + "|",
    ]  # fmt: skip
    for model, s in summary.items():
        lines.append(f"| {model} | " + " | ".join(verdict(model, k, s, goals=False) for k in GOALS) + " |")
    head = " | ".join(f"rows/s @{c}" for c in levels)
    for model, s in summary.items():
        lines += ["", f"## {model}", "", f"| server | {head} | mean ms @{one} | mean ms @{one}, grpcio client | p50 ms "
                  f"@{top} | p99 ms @{top} | note |", "| --- " * (len(levels) + 6) + "|"]  # fmt: skip
        for server, errors in s["errors"].items():
            f, note = s["figures"].get(server), "; ".join(e.replace("|", "/") for e in errors)
            if f is None:
                cells = " | ".join(["-"] * (len(levels) + 4))
            elif server == "inprocess":
                cells = " | ".join(["-"] * len(levels)) + f" | {f['latency_ms']:.2f} (batch 1) | - | - | -"
                note = f"limit {f['limit_rows_s']:,.0f} rows/s at batch {f['limit_batch']}" + (note and f"; {note}")
            else:
                cells = " | ".join(f"{f[c]['rows_s']:,.0f}" for c in levels)
                grpc_ms = "-" if f.get("grpc_one_ms") is None else f"{f['grpc_one_ms']:.2f}"
                cells += f" | {f[one]['mean_ms']:.2f} | {grpc_ms} | {f[top]['p50_ms']:.2f} | {f[top]['p99_ms']:.2f}"
            lines.append(f"| {server} | {cells} | {note} |")
    return "\n".join([*lines, "", "![rows/s against callers](img/suite.png)", ""])


def chart(summary: dict, levels: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        print("no chart: matplotlib is missing (pip install matplotlib)", file=sys.stderr)
        return
    cols, lines = min(3, len(summary)), (len(summary) + 2) // 3
    fig, axes = plt.subplots(lines, cols, figsize=(5 * cols, 3.8 * lines), squeeze=False)
    for ax, (model, s) in zip(axes.flat, summary.items(), strict=False):
        for server, f in s["figures"].items():
            if server == "inprocess":
                label = f"in-process limit (batch {f['limit_batch']})"
                ax.axhline(f["limit_rows_s"], ls="--", color="gray", label=label)
            else:
                ax.plot(levels, [f[c]["rows_s"] for c in levels], marker="o", label=server)
        values = [v for line in ax.get_lines() for v in line.get_ydata()] or [1]
        wide = max(values) > 10 * min(values)  # a log scale where the figures span more than 10x
        ax.set(title=model, xscale="log", yscale="log" if wide else "linear", xlabel="callers", ylabel="rows/s")
        ax.minorticks_off()
        ax.set_ylim(bottom=None if wide else 0)
        if wide:
            ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_xticks(levels, [str(c) for c in levels])
        if s["figures"]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(summary) :]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
