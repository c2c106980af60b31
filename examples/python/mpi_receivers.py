# SPDX-License-Identifier: Apache-2.0
"""Receivers as separate processes, over MPI from Python (mpi4py, Debian's python3-mpi4py).

Rank 0 trains (torch.optim.AdamW, a tiny Qwen3-shaped model) and publishes; ranks 1..N are the
SGLang tensor-parallel ranks of one inference replica (tp = N), each holding only its shard.
A publication is one byte string, so the transport is a broadcast; at the end the ranks'
digests are gathered and compared with the trainer's (dte.replica_matches), and each rank checks
its shard against the trainer's weights sent once for the check.

    mpirun -np 3 python examples/python/mpi_receivers.py [--steps N]

(A trainer sharded over several processes, Megatron-style, is the C++ engine's:
DeltaEngine<..., MpiTwoRound>, examples/mpi_sync.cpp; docs/python.md says why.)
"""
import argparse
import os
import sys

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dte  # noqa: E402
from tiny_qwen3 import CONFIG, TinyQwen3, batches, sglang_shard  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    tp = size - 1
    if tp < 1:
        raise SystemExit("run with mpirun -np 1+TP (rank 0 trains, the others receive)")
    infer = f"tp={tp}"

    if rank == 0:
        model = TinyQwen3(CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        pub = dte.TorchPublisher(model, opt)
        comm.bcast(pub.publish_full(), root=0)
        for tokens in batches(CONFIG, steps=args.steps):
            model.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
            comm.bcast(pub.step(), root=0)
        comm.bcast(None, root=0)  # done
        digests = comm.gather(None, root=0)[1:]
        ok = dte.replica_matches(digests, pub.digest(), config=CONFIG, infer=infer)
        print(f"trainer: {pub.version} publications; the {tp} TP ranks' digests "
              f"{'match' if ok else 'DO NOT match'} the trainer's")
        # the weights once, for each rank's bit-for-bit check of its shard
        comm.bcast({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}, root=0)
        ok = all(comm.gather(None, root=0)[1:]) and ok
        sys.exit(0 if ok else 1)

    ts = rank - 1
    shapes = dte.TorchReceiver.shard_tensors(CONFIG, infer, ts)
    shard = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    rx = dte.TorchReceiver(shard, config=CONFIG, infer=infer, rank=ts)
    applied = 0
    while (msg := comm.bcast(None, root=0)) is not None:
        rx.apply(msg)
        applied += 1
    comm.gather(rx.digest(), root=0)
    weights = comm.bcast(None, root=0)
    expect = sglang_shard(weights, CONFIG, tp, ts)  # sliced by hand, independently of dte
    same = all(torch.equal(shard[n].view(torch.int16), expect[n].view(torch.int16)) for n in shard)
    print(f"receiver TP rank {ts}: {applied} publications applied, shard "
          f"{'bit-identical' if same else 'DIFFERS'}")
    comm.gather(same, root=0)


if __name__ == "__main__":
    main()
