# SPDX-License-Identifier: Apache-2.0
"""What the vLLM tests share: tiny models of each family dte serves to vLLM (transformers' own
Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, FP32, the trainer; tied and untied
embeddings) whose vocabulary vLLM pads (1000 -> 1024), their checkpoints (config.json + BF16
safetensors, written here: no hub), a deterministic AdamW training loop, the tensors vLLM's TP
rank should hold (sliced here, independently of dte's layout code), and greedy generation."""
import hashlib
import json
import os

import torch
import transformers

CONFIG = dict(
    architectures=["Qwen3ForCausalLM"],
    vocab_size=1000,  # vLLM pads it to 1024 (a multiple of 64): 24 padding rows in embed and head
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
# family -> (transformers class, config overrides). qwen2-tied: Qwen2.5-0.5B's kind (q/k/v
# biases, tied embeddings, no q/k norm); llama: no biases, no q/k norm, head_dim derived
# (hidden / heads = 32: vLLM's CPU attention has no kernel for 16).
FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "qwen3-tied": ("Qwen3ForCausalLM", "Qwen3Config", dict(tie_word_embeddings=True)),
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config",
                   dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                        head_dim=None, num_attention_heads=2, num_key_value_heads=1,
                        rope_theta=1000000.0)),
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(architectures=["LlamaForCausalLM"], head_dim=None, num_attention_heads=2,
                   num_key_value_heads=1, rms_norm_eps=1e-5)),
}
# (the last is longer than a KV block: the prefix cache holds its blocks from one version to the next)
PROMPTS = [[1, 2, 3, 4], [17, 400, 3, 999, 512], [7] * 9, [250, 251, 252], list(range(100, 900, 20))]
# Small CPU engines: eager, no tokenizer (token ids in and out), a small KV cache in blocks of
# 32 tokens (the CPU default, 128, would leave the prefix cache unused by these prompts).
ENGINE = dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=64,
              kv_cache_memory_bytes=64 << 20, seed=0, block_size=32)


def qwen3_config(**overrides):
    return transformers.Qwen3Config(**{**CONFIG, **overrides})


def family_config(family="qwen3", **overrides):
    model_cls, config_cls, extra = FAMILIES[family]
    fields = {**CONFIG, **extra, **overrides}
    fields = {k: v for k, v in fields.items() if v is not None}
    return getattr(transformers, config_cls)(**fields)


def make_trainer(seed=0, family="qwen3", **overrides):
    torch.manual_seed(seed)
    config = family_config(family, **overrides)
    return getattr(transformers, FAMILIES[family][0])(config).float()


def adamw(model, lr=1e-5):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model, optimizer, step):
    """One deterministic language-model step on a noisy repeating pattern."""
    g = torch.Generator().manual_seed(1000 + step)
    V = CONFIG["vocab_size"]
    start = torch.randint(0, V, (4, 1), generator=g)
    ramp = (start + torch.arange(16) * 7) % V
    noise = torch.randint(0, V, (4, 16), generator=g)
    x = torch.where(torch.rand(4, 16, generator=g) < 0.8, ramp, noise)
    model(input_ids=x, labels=x).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def write_checkpoint(model, path):
    """config.json + model.safetensors holding the model's BF16 weights."""
    bf16 = type(model)(model.config).to(torch.bfloat16)
    with torch.no_grad():
        for (n, p), (_, q) in zip(bf16.named_parameters(), model.named_parameters()):
            p.copy_(q.detach().to(torch.bfloat16))
    bf16.save_pretrained(path, safe_serialization=True)
    return path


def vllm_rank_tensors(model, tp, rank):
    """TP rank `rank`'s parameters as vLLM's Qwen3 / Qwen2 / Llama hold them, from the trainer's
    BF16 weights: QKVParallelLinear (this rank's q heads, then k, then v; Qwen2's biases alike),
    MergedColumnParallelLinear (gate rows, then up), RowParallelLinear (o, down: columns),
    ParallelLMHead and VocabParallelEmbedding (the vocabulary padded with zero rows to a
    multiple of 64, then split by rows; a tied lm_head is the embedding's parameter, so vLLM
    lists only the embedding), norms replicated."""
    c = model.config
    w = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}

    def rows(x):
        n = x.shape[0] // tp
        return x[rank * n:(rank + 1) * n]

    def cols(x):
        return rows(x.t()).t().contiguous()

    def vocab(x):
        padded = -(-x.shape[0] // 64) * 64
        full = torch.zeros(padded, x.shape[1], dtype=x.dtype)
        full[:x.shape[0]] = x
        return rows(full)

    out = {"model.embed_tokens.weight": vocab(w["model.embed_tokens.weight"]),
           "model.norm.weight": w["model.norm.weight"]}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = vocab(w["lm_head.weight"])
    for L in range(c.num_hidden_layers):
        a = f"model.layers.{L}."
        out[a + "self_attn.qkv_proj.weight"] = torch.cat(
            [rows(w[a + f"self_attn.{x}_proj.weight"]) for x in "qkv"])
        if a + "self_attn.q_proj.bias" in w:
            out[a + "self_attn.qkv_proj.bias"] = torch.cat(
                [rows(w[a + f"self_attn.{x}_proj.bias"]) for x in "qkv"])
        out[a + "self_attn.o_proj.weight"] = cols(w[a + "self_attn.o_proj.weight"])
        out[a + "mlp.gate_up_proj.weight"] = torch.cat(
            [rows(w[a + "mlp.gate_proj.weight"]), rows(w[a + "mlp.up_proj.weight"])])
        out[a + "mlp.down_proj.weight"] = cols(w[a + "mlp.down_proj.weight"])
        for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight"):
            if a + n in w:
                out[a + n] = w[a + n]
    return out


def sha256(t):
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def parameter_mismatches(llm, model, tp):
    """The names of the engine's parameters (every worker, vLLM's own compute_weight_checksums)
    that differ from the trainer's BF16 weights; [] when every one is equal bit for bit (a
    bias vLLM's CPU AMX kernels hold in FP32: equal to the BF16 value converted)."""
    bad = []
    for rank, sums in enumerate(llm.collective_rpc("compute_weight_checksums")):
        expected = vllm_rank_tensors(model, tp, rank)
        got = {k.rsplit(":", 1)[1]: v for k, v in sums.items()}
        if set(got) != set(expected):
            bad.append(f"rank {rank}: parameters {sorted(set(got) ^ set(expected))}")
        bad += [f"rank {rank}: {n}" for n, t in expected.items()
                if got.get(n) not in (sha256(t), sha256(t.float()))]
    return bad


def generate(llm):
    """Greedy tokens and the top-2 logprobs of every step, per prompt (JSON-able)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append({"tokens": list(c.token_ids),
                       "logprobs": [sorted([int(t), float(l.logprob)] for t, l in step.items())
                                    for step in c.logprobs]})
    return result


# How far a multi-process engine's generation may be from another's on the same weights: tokens
# equal, each logprob within 1e-3. Measured on this project's AMX machines at tp = 1: two
# multi-process engines on one checkpoint, or one and an in-process one, differ by up to ~3e-5
# after a few decode steps, and where two tokens nearly tie for the last place of the top 2 they
# may swap (one engine repeats itself exactly). A stale tied lm_head moves logprobs by
# 0.004-0.008 here (24 versions at lr 1e-5). At tp = 2 a multi-process engine does not even
# repeat itself (15 repeats of generate() on one engine: 8 differ from the first by 2^-9 in one
# logprob, one BF16 logit rounded the other way), while an in-process tp = 2 engine repeats itself and equals
# a fresh one exactly: the tp = 2 tests use in-process engines, compared exactly (a tolerance
# over tp = 2's rounding flips would not see a stale head).
MP_LOGPROB_TOLERANCE = 1e-3


def generation_differs(want, got, exact):
    """Why generation `got` differs from `want` ('' if it does not): exactly where `exact` (an
    in-process engine), else by MP_LOGPROB_TOLERANCE."""
    if exact:
        return "" if got == want else "not equal exactly"
    if len(got) != len(want):
        return f"{len(got)} prompts where {len(want)} were expected"
    worst = 0.0
    for w, g in zip(want, got):
        if w["tokens"] != g["tokens"]:
            return f"tokens {g['tokens']} where {w['tokens']} were expected"
        for a, b in zip(w["logprobs"], g["logprobs"]):
            a, b = dict(map(tuple, a)), dict(map(tuple, b))
            for t in set(a) | set(b):
                if t in a and t in b:
                    worst = max(worst, abs(a[t] - b[t]))
                else:  # a near tie for the last place of the top 2 may swap it
                    x, other = (a[t], b) if t in a else (b[t], a)
                    worst = max(worst, abs(x - min(other.values())))
    return f"a logprob {worst:.3g} away" if worst > MP_LOGPROB_TOLERANCE else ""


def reference_reason(full, deltas_since_full, why=None):
    """Why the reference (reference.py) runs a fresh stock engine on a version's checkpoint, or
    None where it does not. A fresh engine costs ~3 s at tp = 1 and ~14 s at tp = 2, and the
    versions in the middle of a run of deltas repeat the path of the ones before them: every
    version's parameters are still checked bit for bit (parameter_mismatches), while generation
    is compared where something differs: every full publication, the first and second delta after
    one (a copy refreshed on every other update shows there), the end of each run of deltas, the
    deltas after refused publications, and whatever the scenario names (`why`)."""
    if why:
        return why
    if full:
        return "a full publication"
    if deltas_since_full == 1:
        return "the first delta after a full publication"
    if deltas_since_full == 2:
        return "the second delta in a row"
    return None


def reference_versions(record):
    """The versions of a record the reference compares: those with a reason, and the last one (a
    record without reasons, as server.py writes: every version). At tp > 1 each reason once: a
    fresh engine costs ~16 s there, and a second run of deltas after a restart repeats the path
    of the first (the tp = 1 records compare every such version; every version's parameters are
    still checked bit for bit at every tp)."""
    versions = record["versions"]
    picked, seen = [], set()
    for v in versions[:-1]:
        why = v.get("reference", True)
        if not why or (record.get("tp", 1) > 1 and isinstance(why, str) and why in seen):
            continue
        seen.add(why)
        picked.append(v)
    return picked + versions[-1:]


def save_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def load_json(path):
    with open(path) as f:
        return json.load(f)


def bind_cpu_workers(tp):
    """vLLM's CPU platform refuses to place tp > 1 workers on one NUMA node by itself: bind them
    to cores here (before vLLM is imported), unless the caller chose already."""
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(r % os.cpu_count()) for r in range(tp)))
