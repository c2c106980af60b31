# SPDX-License-Identifier: Apache-2.0
"""A tiny Qwen3-shaped causal language model in plain torch, with HF parameter names: what the
Python tests and examples train. Real autograd gradients through embeddings, RMSNorm, q/k/v/o
with per-head q/k norms and grouped KV heads, causal attention, SwiGLU MLP and the LM head."""
import math

import torch
from torch import nn

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,  # != hidden / heads, as in the real Qwen3 models
    "intermediate_size": 160,
    "vocab_size": 384,  # a multiple of 64: SGLang's padding adds no rows
    "tie_word_embeddings": False,
}


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, d = c["hidden_size"], c["head_dim"]
        self.nq, self.nkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], d
        self.q_proj = nn.Linear(H, self.nq * d, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nq * d, H, bias=False)
        self.q_norm = RMSNorm(d)
        self.k_norm = RMSNorm(d)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nq, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        rep = self.nq // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, self.nq * self.d))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, F = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(H, F, bias=False)
        self.up_proj = nn.Linear(H, F, bias=False)
        self.down_proj = nn.Linear(F, H, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"])
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"])


class TinyQwen3(nn.Module):
    def __init__(self, config=None, seed=0):
        super().__init__()
        self.config = dict(config or CONFIG)
        torch.manual_seed(seed)
        self.model = Body(self.config)
        self.lm_head = nn.Linear(self.config["hidden_size"], self.config["vocab_size"], bias=False)

    def forward(self, tokens):
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batches(config=None, steps=50, batch=4, length=16, seed=1):
    """Token batches with some structure (a noisy repeating pattern) so the loss can fall."""
    c = config or CONFIG
    g = torch.Generator().manual_seed(seed)
    V = c["vocab_size"]
    for _ in range(steps):
        start = torch.randint(0, V, (batch, 1), generator=g)
        ramp = (start + torch.arange(length) * 7) % V
        noise = torch.randint(0, V, (batch, length), generator=g)
        keep = torch.rand(batch, length, generator=g) < 0.8
        yield torch.where(keep, ramp, noise)


def sglang_shard(weights, config, tp, ts):
    """SGLang TP rank ts's tensors, sliced by hand from the HF tensors `weights` (name -> tensor):
    QKVParallelLinear (q, k, v rows of this rank, fused), MergedColumnParallelLinear (gate, up),
    RowParallelLinear (o, down: columns), VocabParallelEmbedding (rows), norms replicated. An
    oracle independent of dte's C++ layout code, for configs with kv_heads divisible by tp and
    a vocabulary SGLang does not pad (a multiple of 64 * tp)."""
    c = config
    assert c["num_key_value_heads"] % tp == 0 and c["vocab_size"] % (64 * tp) == 0

    def rows(x):
        n = x.shape[0] // tp
        return x[ts * n:(ts + 1) * n]

    def cols(x):
        return rows(x.t()).t()

    out = {"model.embed_tokens.weight": rows(weights["model.embed_tokens.weight"]),
           "lm_head.weight": rows(weights["lm_head.weight"]),
           "model.norm.weight": weights["model.norm.weight"]}
    for L in range(c["num_hidden_layers"]):
        a = f"model.layers.{L}."
        out[a + "self_attn.qkv_proj.weight"] = torch.cat(
            [rows(weights[a + f"self_attn.{x}_proj.weight"]) for x in "qkv"])
        out[a + "self_attn.o_proj.weight"] = cols(weights[a + "self_attn.o_proj.weight"])
        out[a + "mlp.gate_up_proj.weight"] = torch.cat(
            [rows(weights[a + "mlp.gate_proj.weight"]), rows(weights[a + "mlp.up_proj.weight"])])
        out[a + "mlp.down_proj.weight"] = cols(weights[a + "mlp.down_proj.weight"])
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            out[a + n + ".weight"] = weights[a + n + ".weight"]
    return {n: t.contiguous() for n, t in out.items()}
