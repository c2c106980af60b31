# SPDX-License-Identifier: Apache-2.0
"""A complete small RL-style loop with dte (docs/python.md).

The trainer holds a tiny Qwen3-shaped policy in FP32 and trains it with torch.optim.AdamW on a
REINFORCE objective; two inference workers hold BF16 copies and generate the rollouts:
  * worker A receives every publication directly (the bytes, as a socket or a queue would carry
    them) into the parameters of its own served model;
  * worker B follows shared storage (dte.StorageWriter / dte.StorageReader), as a rollout
    cluster elsewhere would, and polls only every few steps.
After every publication both workers' weights are checked bit for bit against
param.to(torch.bfloat16).

    python examples/python/rl_loop.py [--steps N] [--dir DIR]
"""
import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dte  # noqa: E402
from tiny_qwen3 import CONFIG, TinyQwen3  # noqa: E402

TARGET = 7  # the reward: how often the policy emits this token


@torch.no_grad()
def rollout(policy, prompts, length):
    """Samples `length` tokens per prompt from the served (BF16) policy."""
    seq = prompts
    for _ in range(length):
        logits = policy(seq)[:, -1].float()
        nxt = torch.multinomial(logits.softmax(-1), 1)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def reinforce_loss(model, seq, prompt_len, reward):
    logp = model(seq[:, :-1]).log_softmax(-1)
    taken = logp.gather(-1, seq[:, 1:].unsqueeze(-1)).squeeze(-1)[:, prompt_len - 1:]
    advantage = reward - reward.mean()
    return -(advantage.unsqueeze(1) * taken).mean()


def mismatches(model, served):
    return sum(int((s.view(torch.int16) != p.detach().to(torch.bfloat16).view(torch.int16)).sum())
               for (n, p), s in zip(model.named_parameters(), served))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dir", default=None, help="storage root (default: a temporary directory)")
    ap.add_argument("--poll-every", type=int, default=3)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="dte-rl-")

    torch.manual_seed(0)
    policy = TinyQwen3(CONFIG, seed=0)  # the trainer's FP32 policy
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3, weight_decay=0.0)
    pub = dte.TorchPublisher(policy, opt, detect="bf16", publish_every=1)

    # Two served models (what SGLang/vLLM would hold), their parameters written in place by dte.
    worker_a = TinyQwen3(CONFIG, seed=123).to(torch.bfloat16).eval()
    worker_b = TinyQwen3(CONFIG, seed=456).to(torch.bfloat16).eval()
    rx_a = dte.TorchReceiver({n: p.data for n, p in worker_a.named_parameters()})
    rx_b = dte.TorchReceiver({n: p.data for n, p in worker_b.named_parameters()}, config=CONFIG)
    store = dte.StorageWriter(root, CONFIG)
    reader_b = dte.StorageReader(root, rx_b, name="worker-b")

    first = pub.publish_full()
    rx_a.apply(first)
    store.write(first)
    reader_b.poll()
    served_a = [p.data for p in worker_a.parameters()]
    served_b = [p.data for p in worker_b.parameters()]
    assert mismatches(policy, served_a) == 0 and mismatches(policy, served_b) == 0

    prompts = torch.randint(0, CONFIG["vocab_size"], (16, 4))
    for step in range(1, args.steps + 1):
        seq = rollout(worker_a, prompts, length=12)  # rollouts from the synced BF16 policy
        reward = (seq[:, 4:] == TARGET).float().sum(1)
        reinforce_loss(policy, seq, 4, reward).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        msg = pub.step()
        report = rx_a.apply(msg)
        store.write(msg)
        assert mismatches(policy, served_a) == 0, "worker A differs from the trainer"
        line = (f"step {step:3d}: reward {reward.mean():.3f}, v{report['version']} "
                f"{report['changed']} changed ({len(msg)} bytes)")
        if step % args.poll_every == 0 or step == args.steps:
            polled = reader_b.poll()
            assert mismatches(policy, served_b) == 0, "worker B differs from the trainer"
            line += f"; worker B polled {polled['applied']}"
        print(line)
    assert pub.digest() == rx_a.digest() == rx_b.digest()
    print(f"both workers bit-identical to the trainer's BF16 policy after every publication "
          f"(storage root {root})")


if __name__ == "__main__":
    main()
