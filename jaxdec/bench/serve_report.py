"""What `jaxdec bench serve` prints and draws, from its report (the JSON it writes).

    print_report(report)            # tables: with rich where installed, else plain text
    plot(report, "bench-serve.png") # queue length over time, one panel per load

The queue is counted by the client (requests sent whose first token has not arrived), so
every server is counted the same way.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from jaxdec.bench.serve_stats import ATTAINMENT, queue_series

LATENCIES = (("TTFT", "ttft_s", 1e3), ("TPOT", "tpot_s", 1e3), ("ITL", "itl_s", 1e3), ("E2E", "e2e_s", 1.0))


def _num(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"


def brief(load: dict) -> str:
    """One line of a run's figures, for the progress log."""
    ms = lambda key: _num(None if load[key]["p50"] is None else 1e3 * load[key]["p50"])
    return (f"TTFT p50 {ms('ttft_s')} ms, TPOT p50 {ms('tpot_s')} ms, {load['output_tok_s']:.1f} "
            f"output tok/s, SLO met {100 * load['slo_attainment']:.0f}%, failed {load['failed']}")


def _render(title: str, headers: list[str], rows: list[list[str]], *, labels: int = 2) -> None:
    """A titled table; its first `labels` columns are names (left-aligned), the rest numbers."""
    if not rows:
        return
    print(f"\n{title}")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
        for line in [headers, *rows]:
            print("  ".join(c.ljust(w) if i < labels else c.rjust(w)
                            for i, (c, w) in enumerate(zip(line, widths))))
        return
    table = Table()
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < labels else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=None if sys.stdout.isatty() else 220).print(table)


def _latency_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, r in report["systems"].items():
        for ld in r.get("loads", ()):
            cells = [_num(None if ld[k][q] is None else scale * ld[k][q])
                     for _, k, scale in LATENCIES for q in ("p50", "p99")]
            rows.append([name, ld["name"], *cells, _num(ld["output_tok_s"]), _num(ld["request_s"]),
                         _num(ld["goodput_req_s"]), f"{100 * ld['slo_attainment']:.0f}%",
                         f"{ld['requests'] - ld['failed']}/{ld['requests']}"])
    return rows


def _latency_table(report: dict) -> None:
    s = report["settings"]
    headers = ["system", "load"] + [f"{label} p{q} {'ms' if scale > 1 else 's'}"
                                    for label, _, scale in LATENCIES for q in (50, 99)]
    headers += ["out tok/s", "req/s", "goodput req/s", "SLO met", "done"]
    _render(f"Open loop, {s['requests']} requests a load (goodput: TTFT <= {s['ttft_slo']} s and "
            f"TPOT <= {s['tpot_slo']} s)", headers, _latency_rows(report))


def _queue_table(report: dict) -> None:
    rows = [[name, ld["name"], _num(ld["queue"]["first_half"]), _num(ld["queue"]["second_half"]),
             str(ld["queue"]["peak"])]
            for name, r in report["systems"].items() for ld in r.get("loads", ()) if ld["rate"] is not None]
    _render("Queue while the requests were sent (waiting for a first token, time-averaged; a server "
            "that falls behind has a second half above the first)",
            ["system", "load", "1st half", "2nd half", "peak"], rows)


def _closed_table(report: dict) -> None:
    clients = report["settings"]["clients"]
    rows = []
    for name, r in report["systems"].items():
        by = {c["clients"]: c for c in r.get("closed", ())}
        if by:
            rates = [by[c]["output_tok_s"] if c in by else None for c in clients]
            gain = rates[-1] / rates[0] if rates[0] and rates[-1] else None
            rows.append([name, *(_num(v) for v in rates), _num(gain)])
    headers = ["system", *(f"{c} client{'s' * (c > 1)} out tok/s" for c in clients),
               f"{clients[-1]} / {clients[0]}"]
    _render("Closed loop (each client sends its next request when its last finished)", headers, rows,
            labels=1)


def _ratio_table(report: dict) -> None:
    for base, by_system in report["ratios"].items():
        rows = [[name, load, *(_num(v) for v in figs.values())]
                for name, loads in by_system.items() for load, figs in loads.items()]
        if rows:
            _render(f"Ratios {base} at the same load (>1: more throughput; for latency, slower)",
                    ["system", "load", "out tok/s", "goodput", "TTFT p50", "TPOT p50"], rows)


def _capacity_lines(report: dict) -> list[str]:
    rates = report["settings"]["rates"]
    out = [f"Capacity: the highest tested rate (of {', '.join(f'{r:g}' for r in rates)} requests/s) at "
           f"which, as at every lower one, >= {ATTAINMENT:.0%} of requests met both SLOs"]
    for name, cap in report["capacity_req_s"].items():
        said = (f"< {min(rates):g}/s" if cap is None else
                f">= {cap:g}/s (every rate held)" if cap == max(rates) else f"{cap:g}/s")
        out.append(f"  {name}: {said}")
    v = report["sla_vs_static"]
    if v["ratio"] is not None:
        top = " (held the highest rate: add higher --rates to separate them)" if max(rates) in (
            v["sla_req_s"], v["best_fixed_req_s"]) else ""
        out.append(f"  sla over the best fixed batch limit ({v['best_fixed']}: {v['best_fixed_req_s']:g}/s): "
                   f"{v['ratio']:.2f}x (2503.05248 reports {v['paper_ratio']:.2f}x; resolution: the rate "
                   f"ladder){top}")
    else:
        out.append("  sla over the best fixed batch limit: not measured (needs sla and fcfs runs "
                   "that each held the lowest rate)")
    return out


def _server_lines(report: dict) -> list[str]:
    out = [f"Host: {report.get('host', '?')}", "Servers:"]
    for name, r in report["systems"].items():
        out.append(f"  {name}: {' '.join(r['argv'])}")
        if "error" in r:
            out.append(f"    error: {r['error']}")
        loads = r.get("loads", ())
        runs = [*loads, *({"name": f"closed {c['clients']}", **c} for c in r.get("closed", ()))]
        short = [ld["name"] for ld in runs if ld["outputs_as_asked"] < 1]
        if short:
            out.append(f"    outputs shorter or longer than asked in: {', '.join(short)}")
        for ld in runs:
            if ld["failed"]:
                out.append(f"    {ld['failed']} failed in {ld['name']}: {'; '.join(ld['errors'])}")
        if loads:
            out.append(f"    ready in {r['ready_s']} s; mean prompt tokens (its usage): "
                       f"{_num(loads[0]['mean_prompt_tokens'], 4)}")
    return out


def print_report(report: dict) -> None:
    _latency_table(report)
    _queue_table(report)
    _closed_table(report)
    _ratio_table(report)
    print("\n" + "\n".join(_capacity_lines(report) + _server_lines(report)))


def _queue(load: dict) -> tuple[np.ndarray, np.ndarray]:
    recs = load["records"]
    left = [r["first"] if r["first"] is not None else r["end"] for r in recs]
    t, q = queue_series([r["sent"] for r in recs], left)
    return np.concatenate([[0.0], t]), np.concatenate([[0], q])


def plot(report: dict, path: str) -> None:
    """Queue length (client-side) over time: a panel per load, a line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = [ld["name"] for r in report["systems"].values() for ld in r.get("loads", ())]
    panels = list(dict.fromkeys(names)) or ["(no runs)"]
    cols = min(3, len(panels))
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, squeeze=False,
                             figsize=(5 * cols, 3.4 * math.ceil(len(panels) / cols)))
    for ax, panel in zip(axes.flat, panels):
        for name, r in report["systems"].items():
            for ld in r.get("loads", ()):
                if ld["name"] == panel:
                    ax.step(*_queue(ld), where="post", label=name, linewidth=1.2)
        ax.set_title("burst" if panel == "burst" else f"Poisson {panel}")
        ax.set_xlabel("s since the load began")
        ax.set_ylabel("waiting for a first token")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)
