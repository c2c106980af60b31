#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Audits `dte plan --dump-map` against the independent reference (reference_convert.py):
applies every CSV route to the reference's Megatron tensors and checks that the receivers come
out equal to the reference's receiver tensors, every live element written exactly once.

  check_dump_map.py --reference DIR --map map.csv [--hf]

With --hf the map is `--infer hf` (the plain HF layout) and is checked against hf.safetensors.
"""
import argparse
import csv
import json
import struct
import sys

import torch


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[base + b:base + e]), dtype=torch.float32)
        out[name] = t.clone()
    return out, header.get("__metadata__", {})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--map", required=True)
    ap.add_argument("--hf", action="store_true", help="the map targets the unsharded HF layout")
    args = ap.parse_args()
    meg, _ = read_safetensors(args.reference + "/megatron.safetensors")
    want, _ = read_safetensors(args.reference + ("/hf.safetensors" if args.hf else "/receivers.safetensors"))
    got = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    count = {k: torch.zeros(v.numel(), dtype=torch.int32) for k, v in want.items()}
    rows = 0
    with open(args.map, newline="") as f:
        reader = csv.DictReader(f)
        expected = ["src_tp", "src_pp", "src_ep", "src_dp", "src_param", "src_index",
                    "dst_rank", "dst_tensor", "dst_index"]
        if reader.fieldnames != expected:
            print(f"bad header {reader.fieldnames}", file=sys.stderr)
            return 1
        for r in reader:
            rows += 1
            p = r["src_param"]
            if ".mlp.experts." in p:
                src = f"expert.pp{r['src_pp']}.ep{r['src_ep']}.etp{r['src_tp']}.{p}"
            else:
                src = f"dense.tp{r['src_tp']}.pp{r['src_pp']}.{p}"
            dst = r["dst_tensor"] if args.hf else f"r{r['dst_rank']}.{r['dst_tensor']}"
            i = int(r["dst_index"])
            got[dst][i] = meg[src][int(r["src_index"])]
            count[dst][i] += 1
    bad = 0
    for k, w in want.items():
        c = count[k]
        # Live elements: everything but the zero-filled vocabulary tail, which no route may touch.
        written_once = bool((c <= 1).all())
        equal = torch.equal(got[k][c == 1].view(torch.int32), w[c == 1].view(torch.int32))
        unwritten_zero = bool((w[c == 0] == 0).all())
        vocab = k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight")
        if not (written_once and equal and (vocab and unwritten_zero or bool((c == 1).all()))):
            bad += 1
            print(f"MISMATCH {k}", file=sys.stderr)
    print(f"check_dump_map: {rows} routes applied to {len(want)} receiver tensors, {bad} mismatched")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
