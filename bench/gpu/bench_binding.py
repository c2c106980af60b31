# SPDX-License-Identifier: Apache-2.0
"""dte.TorchPublisher on CUDA tensors (issue 29): the time a publication takes per element of
the model, beside the optimizer step it follows, on one GPU. A Qwen3-shaped model (TinyQwen3
over the config below, ~0.46 B parameters) trains with real gradients and torch.optim.AdamW
(foreach) at a small learning rate; after each optimizer step pub.step() publishes a delta.
Per publication: report["seconds"] (dte's native side: bind, the device detect pass, the
compaction and gather, the copy of the changed elements and their encoding on the host), the
wall time of pub.step(), and the optimizer step's wall time (torch.cuda.synchronize() around
both). Written to --out as JSON; bench/gpu/run.sh runs it on a lent GPU.

    python bench/gpu/bench_binding.py [--out FILE] [--steps N] [--small] [--device cpu]

--device cpu runs the same loop on the host path (a check of the script itself, or a ratio).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))

CONFIG = {  # Qwen3-shaped, ~0.46 B parameters
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 5632, "vocab_size": 32000, "tie_word_embeddings": False,
}
SMALL = {  # the demo model (small-qwen3), for a quick check
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 768, "vocab_size": 8000, "tie_word_embeddings": False,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    import torch

    import dte
    from tiny_qwen3 import TinyQwen3, batches

    result = {"command": "python bench/gpu/bench_binding.py" + (" --small" if args.small else "")
              + (" --device cpu" if args.device == "cpu" else "")}
    cuda = args.device == "cuda"
    if cuda and (not torch.cuda.is_available() or not dte._native.cuda_built):
        result["status"] = "skipped: no CUDA device torch can use, or dte built without nvcc"
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    config = SMALL if args.small else CONFIG
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = TinyQwen3(config).to(device)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-5, foreach=True)
    pub = dte.TorchPublisher(model, opt)
    t0 = time.perf_counter()
    full = pub.publish_full()
    full_s = time.perf_counter() - t0
    rows = []
    for i, tokens in enumerate(batches(config, steps=args.steps + 2, batch=2, length=32)):
        model.loss(tokens.to(device)).backward()
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        t_opt = time.perf_counter() - t0
        opt.zero_grad()
        t0 = time.perf_counter()
        msg = pub.step()
        t_pub = time.perf_counter() - t0
        r = pub.report
        if i >= 2:  # the first two warm up (module load, the pools)
            rows.append({"optimizer_step_s": t_opt, "pub_step_s": t_pub, "native_s": r["seconds"],
                         "scanned": r["scanned"], "changed": r["changed"], "bytes": len(msg)})
    elements = sum(p.numel() for _, p in named)
    native = statistics.median(x["native_s"] for x in rows)
    opt_s = statistics.median(x["optimizer_step_s"] for x in rows)
    result.update({
        "status": "ok",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "elements": elements,
        "publications": len(rows),
        "full_publication_s": full_s,
        "full_publication_bytes": len(full),
        "median_native_s": native,
        "median_pub_step_s": statistics.median(x["pub_step_s"] for x in rows),
        "median_optimizer_step_s": opt_s,
        "native_ns_per_element": 1e9 * native / elements,
        "native_over_optimizer_step": native / opt_s,
        "median_changed_fraction": statistics.median(x["changed"] / x["scanned"] for x in rows),
        "median_bytes": statistics.median(x["bytes"] for x in rows),
        "rows": rows,
    })
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
