# SPDX-License-Identifier: Apache-2.0
"""Per-rank publication time of a sharded trainer (issue 29, done-when 3): the demo model's
shapes (small-qwen3, ~6M parameters) trained with FSDP2 (fully_shard per layer and at the root,
gloo on the CPU) by torch.optim.AdamW on 1, 2 and 3 processes. Per rank and publication:
the time dte's C++ core spends on the rank's part (report["seconds"]: detect, compact,
encode), the wall time of pub.step() (with the collectives and, on rank 0, the merge), and the
elements the rank scans. The part's time should follow the local shard (1/W of the model), not
the model. Needs torch >= 2.6 (the PyPI-torch venv of tools/python-tests.sh).

    python bench/python/bench_sharded.py [--worlds 1,2,3] [--steps N] [--json]

Each rank runs with one OpenMP and one torch thread, so W ranks on a machine with fewer than W
cores share them: compare the ranks' C++ seconds, which the scheduler disturbs least.
"""
import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))

SMALL_QWEN3 = {  # the demo model (dte's preset small-qwen3)
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 768, "vocab_size": 8000, "tie_word_embeddings": False,
}


def rank_main(rank, world, port, steps, warmup, lr, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dte
    from tiny_qwen3 import TinyQwen3, batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = TinyQwen3(SMALL_QWEN3)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, foreach=True)
    pub = dte.TorchPublisher(model, opt)
    pub.publish_full()
    rows = []
    for i, tokens in enumerate(batches(SMALL_QWEN3, steps=steps + warmup, batch=2, length=16, seed=1 + rank)):
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        pub.step()
        wall = time.perf_counter() - t0
        if i >= warmup:
            r = pub.report
            rows.append((r["seconds"], wall, r["scanned"], r["changed"]))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    result = {}
    for world in [int(w) for w in args.worlds.split(",")]:
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, args.steps, args.warmup, args.lr, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        gathered = q.get(timeout=900)
        for p in procs:
            p.join()
            if p.exitcode != 0:
                sys.exit(f"bench_sharded: a rank of world {world} exited with {p.exitcode}")
        ranks = []
        for r, rows in enumerate(gathered):
            ranks.append({
                "rank": r,
                "scanned": rows[-1][2],
                "cpp_ms_median": 1e3 * statistics.median(x[0] for x in rows),
                "step_ms_median": 1e3 * statistics.median(x[1] for x in rows),
                "changed_median": statistics.median(x[3] for x in rows),
            })
        result[world] = ranks
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{'ranks':>5} {'rank':>4} {'scanned':>10} {'C++ ms':>8} {'step() ms':>9} {'ns/elem':>8}")
    for world, ranks in result.items():
        for r in ranks:
            print(f"{world:>5} {r['rank']:>4} {r['scanned']:>10} {r['cpp_ms_median']:>8.2f} "
                  f"{r['step_ms_median']:>9.2f} {1e6 * r['cpp_ms_median'] / r['scanned']:>8.2f}")


if __name__ == "__main__":
    main()
