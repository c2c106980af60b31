#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# The plots of docs/benchmarks.md, from the JSON of `dte bench compare --json`:
#   tools/plot_benchmarks.py compare.json docs/img
# writes compare_e2e.png (end-to-end seconds per approach per link), compare_bytes.png (bytes
# per publication, same cluster and through storage), compare_memory.png (peak extra memory of
# sender and receiver) and compare_series.png (dte's changed fraction and bytes per publication
# over the series). Needs matplotlib (Debian: python3-matplotlib).
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
with open(src) as f:
    j = json.load(f)
names = list(j["approaches"])
A = j["approaches"]
title = f"{j['model']}, {j['layers']} layer(s), {j['train']} -> {j['infer']}, lr {j['lr']:g}"
width = 0.8 / 3


def bars(ax, groups, series, labels, ylabel):
    for k, (vals, label) in enumerate(zip(series, labels)):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, vals, width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.set_title(title, fontsize=9)


links = [("450GBps", "450 GB/s (NVLink)"), ("50GBps", "50 GB/s (IB NDR)"),
         ("10gbps", "10 Gbps (storage)")]
fig, ax = plt.subplots(figsize=(8, 4.5))
bars(ax, names, [[A[n]["e2e_s"][k] for n in names] for k, _ in links], [l for _, l in links],
     "seconds per publication (compute measured + bytes / link)")
fig.tight_layout()
fig.savefig(os.path.join(out, "compare_e2e.png"), dpi=110)

fig, ax = plt.subplots(figsize=(8, 4.5))
bars(ax, names, [[A[n]["bytes"] for n in names], [A[n]["storage"]["bytes"] for n in names]],
     ["same cluster", "through storage"], "bytes per publication")
fig.tight_layout()
fig.savefig(os.path.join(out, "compare_bytes.png"), dpi=110)

fig, ax = plt.subplots(figsize=(8, 4.5))
bars(ax, names, [[max(1, A[n]["sender_peak_extra_bytes"]) for n in names],
                 [max(1, A[n]["receiver_peak_extra_bytes"]) for n in names]],
     ["sender", "receiver"], "peak extra heap bytes (measured)")
fig.tight_layout()
fig.savefig(os.path.join(out, "compare_memory.png"), dpi=110)

s = j.get("series", [])
if s:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [x["step"] for x in s]
    ax.plot(steps, [100 * x["changed_fraction"] for x in s], color="C0")
    ax.set_xlabel("publication (one optimizer step each)")
    ax.set_ylabel("changed elements (%)", color="C0")
    ax2 = ax.twinx()
    ax2.plot(steps, [x["bytes"] / 2**20 for x in s], color="C1", label="same cluster")
    ax2.plot(steps, [x["storage_bytes"] / 2**20 for x in s], color="C2", label="storage")
    ax2.set_ylabel("MiB per publication")
    ax2.legend(loc="upper right")
    ax.set_title("dte: " + title, fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "compare_series.png"), dpi=110)
print("plots written to", out)
