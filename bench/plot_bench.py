#!/usr/bin/python3
"""Plots e2e_bench's CSVs (bench/e2e_bench.cc) as the PNGs that
docs/PERFORMANCE.md shows.

    /usr/bin/python3 bench/plot_bench.py <csv dir> <png dir>

Writes latency_vs_size.png, throughput_vs_clients.png,
throughput_vs_batch.png, memory_vs_registrations.png (line plots) and
big_memory.png, pipelining.png (bar plots). Needs Debian's
python3-matplotlib (scripts/install-deps.sh installs it).
"""

import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def read(directory, name, text_columns=()):
    """The rows of <directory>/<name> as dicts of floats (of strings for the
    columns in text_columns)."""
    with open(os.path.join(directory, name), newline="") as f:
        return [{k: v if k in text_columns else float(v)
                 for k, v in row.items()} for row in csv.DictReader(f)]


def column(rows, key):
    return [row[key] for row in rows]


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(path)


# One figure: (png, csv, x column, x label, y label, title, log y, series),
# each series (y column, style, label, scale).
KIB = 1 << 10
MIB = 1 << 20
FIGURES = [
    ("latency_vs_size.png", "latency_vs_size.csv", "size_bytes",
     "registration size", "RegisterMr + DeregisterMr, µs",
     "Latency against size (new registration each time)", True, [
         ("mrd_p50_us", "o-", "mrd (pins), p50", 1),
         ("mrd_p99_us", "o:", "mrd (pins), p99", 1),
         ("floor_p50_us", "s-", "floor (inline), p50", 1),
         ("floor_hop_p50_us", "^-", "floor (hop), p50", 1),
     ]),
    ("throughput_vs_clients.png", "throughput_vs_clients.csv", "clients",
     "client threads (one fd session each)",
     "RegisterMr + DeregisterMr pairs/s (64 KiB)",
     "Throughput against clients", False, [
         ("mrd_pairs_per_s", "o-", "mrd (pins)", 1),
         ("floor_pairs_per_s", "s-", "floor (inline)", 1),
         ("floor_hop_pairs_per_s", "^-", "floor (hop)", 1),
     ]),
    ("throughput_vs_batch.png", "throughput_vs_batch.csv", "batch",
     "items per RegisterMrBatch / DeregisterMrBatch",
     "4 KiB registrations/s (register + deregister)",
     "Throughput against batch size", True, [
         ("mrd_regs_per_s", "o-", "mrd batches (pins)", 1),
         ("mrd_single_regs_per_s", "k--", "mrd single calls", 1),
         ("floor_regs_per_s", "s-", "floor batches (inline)", 1),
         ("floor_hop_regs_per_s", "^-", "floor batches (hop)", 1),
     ]),
    ("memory_vs_registrations.png", "memory_vs_registrations.csv", "live",
     "live 4 KiB registrations", "mrd's resident memory, MiB",
     "Memory against live registrations", False, [
         ("rss_anon_bytes", "o-", "RssAnon (mrd's own memory)", 1 / MIB),
         ("vm_rss_bytes", "s-", "VmRSS (with the registered pages it maps)",
          1 / MIB),
     ]),
]


def tick_label(column_name, value):
    if column_name != "size_bytes":
        return f"{value:g}"
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


def plot(data, out, figure):
    png, name, x_key, x_label, y_label, title, log_y, series = figure
    rows = read(data, name)
    x = column(rows, x_key)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, style, label, scale in series:
        ax.plot(x, [v * scale for v in column(rows, key)], style, label=label)
    if x_key != "live":
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([tick_label(x_key, v) for v in x])
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save(fig, out, png)


def label_bars(ax, bars, labels):
    for bar, label in zip(bars, labels):
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2,
                            bar.get_height()),
                    xytext=(0, 3), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8)


def plot_big_memory(data, out):
    """Figure f: GB/s of the mlock floor and of mrd, one bar each."""
    rows = read(data, "big_memory.csv", text_columns=("case",))
    if not rows:
        print("big_memory.csv is empty (figure f not run): no plot")
        return
    names = []
    for row in rows:
        page = "4 KiB" if row["page_bytes"] == 4096 else "2 MiB"
        if row["case"] == "floor_mlock":
            names.append(f"floor: one thread's\nmlock, {page} pages")
        else:
            names.append(f"mrd, {page} pages,\n4 registrations at once")
    rates = column(rows, "gb_per_s")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bars = ax.bar(names, rates, color=["0.6", "C0", "C1"][:len(rows)])
    label_bars(ax, bars, [f"{r:,.1f} GB/s\n{x:.3g}× floor" for r, x in
                          zip(rates, column(rows, "x_floor"))])
    ax.set_yscale("log")
    ax.set_ylim(bottom=1, top=max(rates) * 8)
    size = rows[0]["total_bytes"] / (1 << 30)
    ax.set_ylabel("GB/s (log)")
    ax.set_title(f"{size:g} GiB of written memfds: the mlock floor and mrd")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    save(fig, out, "big_memory.png")


def plot_pipelining(data, out):
    """Figure g: synchronous and pipelined RegisterMr/s for each server."""
    rows = read(data, "pipelining.csv", text_columns=("server",))
    names = {"mrd": "mrd (pins)", "floor_inline": "floor (inline)",
             "floor_hop": "floor (hop)"}
    x = range(len(rows))
    width = 0.38
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.bar([i - width / 2 for i in x], column(rows, "sync_requests_per_s"),
           width, label="synchronous, one call at a time")
    depth = int(rows[0]["outstanding"])
    bars = ax.bar([i + width / 2 for i in x],
                  column(rows, "pipelined_requests_per_s"), width,
                  label=f"{depth} calls outstanding")
    label_bars(ax, bars, [f"{v:.1f}×" for v in
                          column(rows, "pipelined_over_sync")])
    ax.set_xticks(list(x))
    ax.set_xticklabels([names.get(r["server"], r["server"]) for r in rows])
    ax.set_ylabel("RegisterMr requests/s (new 4 KiB each)")
    ax.set_title("Pipelining on one channel")
    ax.set_ylim(top=max(column(rows, "pipelined_requests_per_s")) * 1.35)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    save(fig, out, "pipelining.png")


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    data, out = argv[1], argv[2]
    os.makedirs(out, exist_ok=True)
    for figure in FIGURES:
        plot(data, out, figure)
    plot_big_memory(data, out)
    plot_pipelining(data, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
