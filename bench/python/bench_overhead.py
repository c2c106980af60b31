# SPDX-License-Identifier: Apache-2.0
"""The Python binding's call overhead per publication (issue 15, done-when 4): on the demo
model's shapes (small-qwen3, ~6M parameters) trained by torch.optim.AdamW, each publication's
wall time through the Python API (pub.step() and rx.apply(msg), as a user calls them) against
the time the C++ core spends inside the same calls (publication::Publisher::publish and
HfReceiver::apply, timed in C++ in the same run). Overhead = Python wall / C++ inside - 1.
Target: < 5 %.

    python bench/python/bench_overhead.py [--steps N] [--json]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
import dte  # noqa: E402
from tiny_qwen3 import TinyQwen3, batches  # noqa: E402

SMALL_QWEN3 = {  # the demo model (dte's preset small-qwen3)
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 768, "vocab_size": 8000, "tie_word_embeddings": False,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = TinyQwen3(SMALL_QWEN3)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, foreach=True)
    pub = dte.TorchPublisher(model, opt)
    served = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in model.named_parameters()}
    rx = dte.TorchReceiver(served)
    rx.apply(pub.publish_full())
    rows = []
    for i, tokens in enumerate(batches(SMALL_QWEN3, steps=args.steps + args.warmup, batch=2, length=16)):
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        msg = pub.step()
        t1 = time.perf_counter()
        rep = rx.apply(msg)
        t2 = time.perf_counter()
        if i < args.warmup:
            continue
        inner_pub, inner_rx = pub.report["seconds"], rep["seconds"]
        rows.append({"py_step_s": t1 - t0, "cpp_step_s": inner_pub, "py_apply_s": t2 - t1,
                     "cpp_apply_s": inner_rx, "changed": rep["changed"], "bytes": len(msg)})
    bad = sum(int((served[n].view(torch.int16) != p.detach().to(torch.bfloat16).view(torch.int16)).sum())
              for n, p in model.named_parameters())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    py = med["py_step_s"] + med["py_apply_s"]
    cpp = med["cpp_step_s"] + med["cpp_apply_s"]
    total_py = sum(r["py_step_s"] + r["py_apply_s"] for r in rows)
    total_cpp = sum(r["cpp_step_s"] + r["cpp_apply_s"] for r in rows)
    out = {
        "model": "small-qwen3 shapes", "parameters": sum(p.numel() for p in model.parameters()),
        "publications": len(rows), "threads": torch.get_num_threads(),
        "median": med,
        "overhead_median": py / cpp - 1,
        "overhead_total": total_py / total_cpp - 1,
        "overhead_step_median": med["py_step_s"] / med["cpp_step_s"] - 1,
        "overhead_apply_median": med["py_apply_s"] / med["cpp_apply_s"] - 1,
        "receiver_mismatches": bad,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{out['parameters']} parameters, {len(rows)} publications, median changed "
          f"{med['changed']:.0f} ({100 * med['changed'] / out['parameters']:.2f} %), message {med['bytes']:.0f} B")
    print(f"pub.step():  python {1e3 * med['py_step_s']:.3f} ms, inside C++ {1e3 * med['cpp_step_s']:.3f} ms "
          f"(+{100 * out['overhead_step_median']:.2f} %)")
    print(f"rx.apply():  python {1e3 * med['py_apply_s']:.3f} ms, inside C++ {1e3 * med['cpp_apply_s']:.3f} ms "
          f"(+{100 * out['overhead_apply_median']:.2f} %)")
    print(f"per publication: +{100 * out['overhead_median']:.2f} % (median), +{100 * out['overhead_total']:.2f} % "
          f"(sum over all); target < 5 %; receiver elements that differ: {bad}")


if __name__ == "__main__":
    main()
