# SPDX-License-Identifier: Apache-2.0
"""Sharded PyTorch trainers on the CPU (gloo), each rank one process, publishing through
dte.TorchPublisher: FSDP2 (fully_shard per layer and at the root; default, foreach and fused
AdamW, Adam, SGD with momentum; bf16 mixed precision; publish_every 4), HSDP (FSDP2 on a
(replicate, shard) mesh), FSDP1 (use_orig_params=True), DDP + ZeroRedundancyOptimizer, and
DTensor tensor parallelism on the MLP. Group rank 0 (or dst) sends each
publication to the test process with the full parameters gathered by torch's own means
(DTensor.full_tensor, FSDP.summon_full_params, the replicated DDP module) in BF16, which the
test compares its receivers with, independently of dte."""
import io
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples", "python"))
import dte  # noqa: E402
from dte.sharded import hf_name  # noqa: E402
from tiny_qwen3 import CONFIG as TINY, Layer, TinyQwen3, batches  # noqa: E402

# A vocabulary no world size divides (385 = 5 * 7 * 11), and q_norm / k_norm of 2 elements:
# fewer rows than ranks. (intermediate_size 162: torch's tensor parallelism of the MLP fails in
# its own backward when 3 ranks split 160 rows unevenly, "Sharding propagation failed")
CONFIG = dict(TINY, vocab_size=385, head_dim=2, intermediate_size=162)
FROZEN = "model.layers.0.post_attention_layernorm.weight"
SKIPPED = "model.layers.1.mlp.up_proj.weight"  # no gradient every third step


def model_for(rank_seed=0):
    m = TinyQwen3(CONFIG, seed=0)  # the same initial weights on every rank
    dict(m.named_parameters())[FROZEN].requires_grad_(False)
    return m


def param_groups(named):
    """Weight decay on matrices only; the frozen parameter in no group."""
    named = list(named)
    decay = [p for n, p in named if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in named if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def loss_of(forward, tokens):
    logits = forward(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def fsdp2(rank, world, variant):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = model_for()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if variant == "bf16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    groups = param_groups(model.named_parameters())
    if variant == "adam":  # L2 weight decay
        opt = torch.optim.Adam(groups, lr=3e-3, betas=(0.9, 0.95))
    elif variant == "sgd":
        opt = torch.optim.SGD(groups, lr=3e-2, momentum=0.9)
    else:
        kw = {"foreach": True} if variant == "foreach" else {"fused": True} if variant == "fused" else {}
        opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), **kw)

    def full():
        return {n: p.full_tensor() for n, p in model.named_parameters()}

    return model, opt, model, full


def hsdp(rank, world, variant):
    """FSDP2 on a 2-D mesh (replicate, shard) of shape (world, 1): DTensors Replicate() x
    Shard(0); every rank holds whole tensors and only replicate coordinate 0 sends."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = model_for()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(param_groups(model.named_parameters()), lr=3e-3, betas=(0.9, 0.95))

    def full():
        return {n: p.full_tensor() for n, p in model.named_parameters()}

    return model, opt, model, full


def fsdp1(rank, world, variant):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = model_for()
    # (device_id: FSDP1 refuses to guess the CPU)
    wrapped = FSDP(model, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({Layer}),
                   device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(param_groups(wrapped.named_parameters()), lr=3e-3, betas=(0.9, 0.95))

    def full():
        with FSDP.summon_full_params(wrapped, writeback=False):
            return {hf_name(n): p.detach().clone() for n, p in wrapped.named_parameters()}

    return wrapped, opt, wrapped, full


def zero(rank, world, variant):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model_for()
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(param_groups(ddp.named_parameters()),
                                  optimizer_class=torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.95))

    def full():
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    return ddp, opt, ddp, full


def tp(rank, world, variant):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = model_for()
    for L, layer in enumerate(model.model.layers):
        parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                             "down_proj": RowwiseParallel()})
    # (fused and foreach AdamW refuse a group mixing DTensors and plain tensors)
    opt = torch.optim.AdamW(param_groups(model.named_parameters()), lr=3e-3, betas=(0.9, 0.95),
                            foreach=False)
    from torch.distributed.tensor import DTensor

    def full():
        return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                for n, p in model.named_parameters()}

    return model, opt, model, full


KINDS = {"fsdp2": fsdp2, "hsdp": hsdp, "fsdp1": fsdp1, "zero": zero, "tp": tp}


def corrupt(opt, rank):
    """An invalid exp_avg_sq element in this rank's local state (a negative second moment);
    returns how to put it back."""
    for p, st in opt.state.items():
        v = st.get("exp_avg_sq")
        if v is None:
            continue
        local = v.to_local() if hasattr(v, "to_local") else v
        if local.numel():
            saved = local.view(-1)[0].item()
            local.view(-1)[0] = -1.0

            def restore():
                local.view(-1)[0] = saved

            return restore
    raise AssertionError(f"rank {rank} holds no optimizer state")


def run(rank, world, port, scenarios, queue, die=None, continue_after=0):
    """One rank: every scenario in turn (name, kind, variant, publish_every, steps). The rank
    that receives the publications puts ("pub", scenario, message, expected BF16 weights,
    digest, report) per publication, then ("done", scenario). Variants: "refuse" (rank world-1's
    state turns invalid after step 7: every rank must raise, and the next publication is full),
    "group" (a group object of its own, the publications on its last rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        for name, kind, variant, every, steps in scenarios:
            model, opt, forward, full = KINDS[kind](rank, world, variant)
            group, dst = None, 0
            if variant == "group":
                group, dst = dist.new_group(list(range(world))), world - 1
            pub = dte.TorchPublisher(model, opt, config=CONFIG, publish_every=every,
                                     continue_after=continue_after, group=group, dst=dst)

            def send(msg):
                # (full() is a collective: every rank calls it for every publication)
                expected = {n: t.detach().to(torch.bfloat16) for n, t in full().items()}
                if rank == dst:
                    assert msg is not None
                    # (as bytes: tensors in a queue would outlive this process's shared memory)
                    buf = io.BytesIO()
                    torch.save(expected, buf)
                    queue.put(("pub", name, msg, buf.getvalue(), pub.digest(), pub.report))
                else:
                    assert msg is None

            # the learning rate moves right after every step, before pub.step(): dte must use
            # the one the step used (its optimizer hook)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.2 * k))
            send(pub.publish_full())
            # data parallel: each rank its own batches; tensor parallel: the same on every rank
            seed = 1 if kind == "tp" else 1 + rank
            for s, tokens in enumerate(batches(CONFIG, steps=steps, seed=seed)):
                loss_of(forward, tokens).backward()
                if s % 3 == 1:
                    # a parameter without a gradient this step (unused): the optimizer skips it,
                    # its step count stays, and dte must know it unchanged
                    {hf_name(n): p for n, p in model.named_parameters()}[SKIPPED].grad = None
                opt.step()
                sched.step()
                opt.zero_grad()
                if die is not None and s == die and rank == world - 1:
                    # mid-publication: this rank has detected and written its part, and dies
                    # before the parts are gathered
                    pub._gather_to_dst = lambda part: os._exit(3)
                if variant == "refuse" and s == 7:
                    restore = corrupt(opt, rank) if rank == world - 1 else None
                    try:
                        pub.step()
                        raise AssertionError(f"rank {rank}: a refused rank's publication went out")
                    except dte.Error as e:
                        if rank == dst:
                            queue.put(("refused", name, f"{type(e).__name__}: {e}"))
                    if restore:
                        restore()
                    continue
                msg = pub.step()
                if (s + 1) % every == 0:
                    send(msg)
                else:
                    assert msg is None
            if rank == dst:
                queue.put(("done", name))
            dist.barrier()
    except Exception as e:  # noqa: BLE001 (reported to the test process, which fails)
        queue.put(("error", rank, f"{type(e).__name__}: {e}"))
        code = 1
    else:
        code = 0
    dist.destroy_process_group()
    # Leave without the interpreter's finalisation: gloo's worker threads can abort a process
    # there (seen once in ~10 runs: "terminate called without an active exception", exit -6,
    # after every scenario had passed; pytorch/pytorch#179291 describes the race).
    queue.close()
    queue.join_thread()
    os._exit(code)
