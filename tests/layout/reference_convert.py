#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Independent tensor-level reference converter for dte's layout differential test.

Written from /work/shared/LAYOUTS.md (§1-§6, §9-§11) only, with torch tensor operations
(view/reshape, chunk, cat, narrow, stack) instead of per-element index formulas, so that an
index-formula mistake elsewhere cannot be repeated here.

  reference_convert.py --model {tiny-qwen3|tiny-qwen3-moe|tiny-qwen3-tied|tiny-qwen2|tiny-llama|CONFIG.json}
                       --train tp=T,pp=P,ep=E,etp=ET,dp=D --infer tp=TS,ep=ES,replicas=R
                       --seed N --out DIR

Missing topology keys default to 1; ep/etp/dp (train) and ep (infer) only matter for MoE models.
Writes three safetensors files into DIR (all F32, written by hand):

  hf.safetensors         HF canonical tensors (LAYOUTS.md §2, per-expert names for MoE).
                         metadata: model, architecture, seed, config (JSON string), V
  megatron.safetensors   dense.tp{tm}.pp{pp}.{megatron name}           for every tm, pp
                         expert.pp{pp}.ep{em}.etp{te}.{megatron name}  for every pp, em, te (MoE)
                         Megatron names are local (layer index inside the stage, expert index
                         inside the EP rank), without the `module.` prefix.
                         metadata: Vp, V, tp, pp, ep, etp, dp, layers_per_stage,
                         experts_per_ep_rank, pad_rows, pad_fill
  receivers.safetensors  r{rank}.{sglang name}, rank = replica*TS + ts, global layer index.
                         metadata: Vs, V, tp, ep, replicas, moe_tp, world

Families (LAYOUTS.md §11): Qwen2 adds q/k/v biases (HF q_proj/k_proj/v_proj.bias; Megatron
linear_qkv.bias in the weight's group-interleaved row order; SGLang qkv_proj.bias cut like the
weight rows); Qwen2 and Llama/Mistral have no q/k norm and may derive head_dim = H / nq; tied
embeddings drop lm_head.weight from HF and SGLang, and Megatron holds output_layer.weight only on
the last stage when pp > 1, as an exact copy of the padded embedding (junk rows included).

Values: every HF tensor element is distinct (a seeded random permutation of the quantiles of a
standard normal, so the values are normally distributed and exactly distinct in float32). Megatron
vocab padding rows (global padded row >= V) hold distinct junk: float32 bit pattern of +1e30
(embedding) or -1e30 (output_layer) plus k = (row - V) * H + col, so every junk value has
|x| >= 1e30. SGLang tail rows (>= V, up to Vs) are 0, as SGLang's weight_loader zero-fills them.

Topologies that do not divide are refused with exit status 2 and a message naming the field.
`--selfcheck` runs test_reference_selfcheck.py's checks (same directory).
"""

import argparse
import json
import math
import os
import struct
import sys

import torch

EXIT_REFUSED = 2

PRESETS = {
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 48,
        "vocab_size": 300,
        "tie_word_embeddings": False,
    },
    "tiny-qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "vocab_size": 300,
        "tie_word_embeddings": False,
    },
    "tiny-qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "tie_word_embeddings": False,
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    },
}

PRESETS["tiny-qwen3-tied"] = {**PRESETS["tiny-qwen3"], "tie_word_embeddings": True}

MEGATRON_VOCAB_DIVISOR = 128  # --make-vocab-size-divisible-by default (LAYOUTS.md §3.2)
SGLANG_VOCAB_DIVISOR = 64  # pad_vocab_size(V, 64) (LAYOUTS.md §5.4)
EMBED_JUNK_BASE = 1e30
OUTPUT_JUNK_BASE = -1e30


class Refused(Exception):
    """A model or topology this converter cannot (or must not) handle; exit status 2."""


# --------------------------------------------------------------------------------------------
# Model config


class Model:
    def __init__(self, cfg, name="config"):
        self.name = name
        self.raw = dict(cfg)
        arch = (cfg.get("architectures") or [None])[0]
        self.arch = arch
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            self.moe = arch == "Qwen3MoeForCausalLM"
            self.qk_norm, self.bias = True, False
        elif arch == "Qwen2ForCausalLM":
            self.moe, self.qk_norm, self.bias = False, False, True
        elif arch in ("LlamaForCausalLM", "MistralForCausalLM"):
            self.moe, self.qk_norm, self.bias = False, False, False
        else:
            raise Refused(f"architectures[0] = {arch!r}: expected Qwen3ForCausalLM, "
                          "Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM or "
                          "MistralForCausalLM")

        def need(key):
            if key not in cfg:
                raise Refused(f"config field {key} is missing")
            v = cfg[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise Refused(f"config field {key} = {v!r}: expected a positive integer")
            return v

        self.H = need("hidden_size")
        self.L = need("num_hidden_layers")
        self.nq = need("num_attention_heads")
        self.ng = need("num_key_value_heads")
        if cfg.get("head_dim") is None:
            if self.H % self.nq:
                raise Refused(f"head_dim absent and hidden_size (H={self.H}) % "
                              f"num_attention_heads (nq={self.nq}) != 0")
            self.d = self.H // self.nq
        else:
            self.d = need("head_dim")
        self.V = need("vocab_size")
        if self.nq % self.ng:
            raise Refused(f"num_attention_heads (nq={self.nq}) % num_key_value_heads "
                          f"(ng={self.ng}) != 0")
        self.qpg = self.nq // self.ng
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if self.tied and self.moe:
            raise Refused("tie_word_embeddings = true with an MoE model is not supported")
        if cfg.get("attention_bias", False) and not self.bias:
            raise Refused("attention_bias = true is not supported (it adds an o_proj bias)")
        if cfg.get("mlp_bias", False):
            raise Refused("mlp_bias = true is not supported")
        if self.moe:
            self.E = need("num_experts")
            self.Fm = need("moe_intermediate_size")
            self.F = cfg.get("intermediate_size")  # unused
            if cfg.get("mlp_only_layers"):
                raise Refused(f"mlp_only_layers = {cfg['mlp_only_layers']!r}: only all-MoE "
                              "layers are supported")
            if cfg.get("decoder_sparse_step", 1) != 1:
                raise Refused(f"decoder_sparse_step = {cfg['decoder_sparse_step']!r}: only 1 "
                              "(every layer MoE) is supported")
        else:
            self.F = need("intermediate_size")
            self.E = self.Fm = None


def load_model(spec):
    if spec in PRESETS:
        return Model(PRESETS[spec], spec)
    if not os.path.isfile(spec):
        raise Refused(f"--model {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a file")
    with open(spec, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise Refused(f"--model {spec!r}: not valid JSON ({e})")
    return Model(cfg, os.path.basename(spec))


# --------------------------------------------------------------------------------------------
# Topologies


TRAIN_KEYS = ("tp", "pp", "ep", "etp", "dp")
INFER_KEYS = ("tp", "ep", "replicas")


def parse_topology(text, keys, what):
    topo = {k: 1 for k in keys}
    if text is None or text.strip() == "":
        return topo
    seen = set()
    for item in text.split(","):
        if "=" not in item:
            raise Refused(f"{what} {text!r}: item {item!r} is not key=value")
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in keys:
            raise Refused(f"{what}: unknown key {k!r} (known: {', '.join(keys)})")
        if k in seen:
            raise Refused(f"{what}: key {k!r} given twice")
        seen.add(k)
        try:
            n = int(v)
        except ValueError:
            raise Refused(f"{what}: {k}={v!r} is not an integer")
        if n <= 0:
            raise Refused(f"{what}: {k}={n} must be positive")
        topo[k] = n
    return topo


def padded_vocab_megatron(V, Tm):
    unit = MEGATRON_VOCAB_DIVISOR * Tm
    return -(-V // unit) * unit


def padded_vocab_sglang(V):
    return -(-V // SGLANG_VOCAB_DIVISOR) * SGLANG_VOCAB_DIVISOR


def validate(m, train, infer):
    """Refuse every topology whose shards would not divide. Messages name field and values."""
    Tm, PP, EP, ETP, DP = (train[k] for k in TRAIN_KEYS)
    TS, ES, _ = (infer[k] for k in INFER_KEYS)

    def req(ok, msg):
        if not ok:
            raise Refused(msg)

    # Megatron (train)
    req(m.nq % Tm == 0, f"num_attention_heads (nq={m.nq}) % train tp (Tm={Tm}) != 0")
    rows = (m.nq + 2 * m.ng) * m.d
    req(rows % Tm == 0, f"fused QKV rows ((nq+2ng)*d={rows}) % train tp (Tm={Tm}) != 0")
    if not m.moe:
        req(m.F % Tm == 0, f"intermediate_size (F={m.F}) % train tp (Tm={Tm}) != 0")
    req(m.L % PP == 0, f"num_hidden_layers (L={m.L}) % train pp (PP={PP}) != 0")
    if m.moe:
        req(m.E % EP == 0, f"num_experts (E={m.E}) % train ep (EP={EP}) != 0")
        req(m.Fm % ETP == 0, f"moe_intermediate_size (Fm={m.Fm}) % train etp (ETP={ETP}) != 0")
        req((Tm * DP) % (ETP * EP) == 0,
            f"train tp*dp (Tm*dp={Tm}*{DP}={Tm * DP}) % train etp*ep "
            f"(etp*ep={ETP}*{EP}={ETP * EP}) != 0 (expert-DP size must be an integer)")
    # SGLang (infer)
    req(m.nq % TS == 0, f"num_attention_heads (nq={m.nq}) % infer tp (TS={TS}) != 0")
    if TS > m.ng:
        req(TS % m.ng == 0, f"infer tp (TS={TS}) > num_key_value_heads (ng={m.ng}) but "
                            f"TS % ng = {TS % m.ng} != 0 (KV replication needs TS % ng == 0)")
    else:
        req(m.ng % TS == 0, f"num_key_value_heads (ng={m.ng}) % infer tp (TS={TS}) = "
                            f"{m.ng % TS} != 0")
    if not m.moe:
        req(m.F % TS == 0, f"intermediate_size (F={m.F}) % infer tp (TS={TS}) != 0")
    else:
        req(m.E % ES == 0, f"num_experts (E={m.E}) % infer ep (ES={ES}) != 0")
        req(TS % ES == 0, f"infer tp (TS={TS}) % infer ep (ES={ES}) != 0")
        Ms = TS // ES
        req(m.Fm % Ms == 0, f"moe_intermediate_size (Fm={m.Fm}) % infer moe-tp "
                            f"(Ms=TS/ES={TS}/{ES}={Ms}) != 0")
    Vs = padded_vocab_sglang(m.V)
    req(Vs % TS == 0, f"padded vocab (Vs={Vs}, V={m.V} padded to 64) % infer tp (TS={TS}) != 0")


# --------------------------------------------------------------------------------------------
# Tensor helpers


def part(t, n, i, dim=0):
    """Equal piece i of n along dim (ColumnParallel / RowParallel / vocab sharding)."""
    pieces = torch.chunk(t, n, dim)
    if len(pieces) != n or any(p.shape[dim] != pieces[0].shape[dim] for p in pieces):
        raise AssertionError(f"dimension {dim} of size {t.shape[dim]} does not split into {n}")
    return pieces[i]


def junk_rows(rows, cols, base):
    """rows x cols distinct float32 values: bits(base) + k, k = row*cols + col.

    For a negative base the bit pattern is a negative int32; adding k still walks away from zero
    (larger magnitude), so every value keeps |x| >= |base|."""
    bits = struct.unpack("<i", struct.pack("<f", base))[0]
    out = (bits + torch.arange(rows * cols, dtype=torch.int64)).to(torch.int32)
    vals = out.view(torch.float32).reshape(rows, cols)
    if not bool(torch.isfinite(vals).all()) or not bool((vals.abs() >= abs(base) * 0.99).all()):
        raise AssertionError("junk range left the finite float32 range")
    return vals


# --------------------------------------------------------------------------------------------
# HF canonical model (LAYOUTS.md §2)


def hf_shapes(m):
    """Ordered (name, shape) of every HF canonical tensor."""
    H, d = m.H, m.d
    out = [("model.embed_tokens.weight", (m.V, H))]
    for L in range(m.L):
        p = f"model.layers.{L}."
        out += [
            (p + "input_layernorm.weight", (H,)),
            (p + "self_attn.q_proj.weight", (m.nq * d, H)),
            (p + "self_attn.k_proj.weight", (m.ng * d, H)),
            (p + "self_attn.v_proj.weight", (m.ng * d, H)),
        ]
        if m.bias:
            out += [
                (p + "self_attn.q_proj.bias", (m.nq * d,)),
                (p + "self_attn.k_proj.bias", (m.ng * d,)),
                (p + "self_attn.v_proj.bias", (m.ng * d,)),
            ]
        if m.qk_norm:
            out += [
                (p + "self_attn.q_norm.weight", (d,)),
                (p + "self_attn.k_norm.weight", (d,)),
            ]
        out += [
            (p + "self_attn.o_proj.weight", (H, m.nq * d)),
            (p + "post_attention_layernorm.weight", (H,)),
        ]
        if m.moe:
            out.append((p + "mlp.gate.weight", (m.E, H)))
            for e in range(m.E):
                q = f"{p}mlp.experts.{e}."
                out += [
                    (q + "gate_proj.weight", (m.Fm, H)),
                    (q + "up_proj.weight", (m.Fm, H)),
                    (q + "down_proj.weight", (H, m.Fm)),
                ]
        else:
            out += [
                (p + "mlp.gate_proj.weight", (m.F, H)),
                (p + "mlp.up_proj.weight", (m.F, H)),
                (p + "mlp.down_proj.weight", (H, m.F)),
            ]
    out += [("model.norm.weight", (H,))]
    if not m.tied:
        out += [("lm_head.weight", (m.V, H))]
    return out


def make_hf(m, seed):
    """Seeded random HF model; all elements of all tensors are distinct float32 values."""
    shapes = hf_shapes(m)
    sizes = [math.prod(s) for _, s in shapes]
    n = sum(sizes)
    if n > 2**31 - 1:
        raise Refused(f"model has {n} elements; this reference is for small test models")
    gen = torch.Generator().manual_seed(seed)
    # A random permutation of the n normal quantiles: normally distributed, exactly distinct
    # (quantile spacing exceeds the float32 spacing for n up to ~3e7).
    perm = torch.randperm(n, generator=gen, dtype=torch.int64)
    u = (perm.to(torch.float64) + 0.5) / n
    flat = (math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)).to(torch.float32)
    if n <= 40_000_000 and torch.unique(flat).numel() != n:
        raise AssertionError("generated values are not distinct")
    hf = {}
    for (name, shape), piece in zip(shapes, torch.split(flat, sizes)):
        hf[name] = piece.reshape(shape).clone()
    return hf


# --------------------------------------------------------------------------------------------
# Megatron-Core per-rank tensors (LAYOUTS.md §3.2, §3.4, §4.1 inverse, §5)


def megatron_qkv_full(m, q, k, v):
    """Unsharded group-interleaved Megatron QKV [ng*(qpg+2)*d, H]: per group [q heads; k; v].
    For the 1-D biases the same with one column, returned 1-D."""
    d = m.d
    bias = q.dim() == 1
    if bias:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    H = q.shape[1]
    qg = q.reshape(m.ng, m.qpg * d, H)  # heads g*qpg .. g*qpg+qpg-1 of group g
    kg = k.reshape(m.ng, d, H)
    vg = v.reshape(m.ng, d, H)
    full = torch.cat([qg, kg, vg], dim=1).reshape(-1, H)
    return full.reshape(-1) if bias else full


def megatron_vocab_padded(m, w, Vp, junk_base):
    return torch.cat([w, junk_rows(Vp - m.V, m.H, junk_base)], dim=0)


def megatron_shards(m, hf, train):
    """Returns (dense, expert, Vp):
    dense[(tm, pp)] = {megatron name: tensor}; expert[(pp, em, te)] = {megatron name: tensor}."""
    Tm, PP, EP, ETP = train["tp"], train["pp"], train["ep"], train["etp"]
    Lps = m.L // PP
    Vp = padded_vocab_megatron(m.V, Tm)
    emb_full = megatron_vocab_padded(m, hf["model.embed_tokens.weight"], Vp, EMBED_JUNK_BASE)
    # Tied: the last stage's output layer (pp > 1 only) is an exact copy of the padded embedding.
    out_full = emb_full.clone() if m.tied else megatron_vocab_padded(
        m, hf["lm_head.weight"], Vp, OUTPUT_JUNK_BASE)
    qkv_full, qkv_bias_full = {}, {}
    for L in range(m.L):
        p = f"model.layers.{L}.self_attn."
        qkv_full[L] = megatron_qkv_full(m, hf[p + "q_proj.weight"], hf[p + "k_proj.weight"],
                                        hf[p + "v_proj.weight"])
        if m.bias:
            qkv_bias_full[L] = megatron_qkv_full(m, hf[p + "q_proj.bias"], hf[p + "k_proj.bias"],
                                                 hf[p + "v_proj.bias"])
    dense = {}
    for pp in range(PP):
        for tm in range(Tm):
            t = {}
            if pp == 0:
                t["embedding.word_embeddings.weight"] = part(emb_full, Tm, tm)
            for i in range(Lps):
                L = pp * Lps + i
                h = f"model.layers.{L}."
                g = f"decoder.layers.{i}."
                t[g + "self_attention.linear_proj.weight"] = part(
                    hf[h + "self_attn.o_proj.weight"], Tm, tm, dim=1)
                t[g + "self_attention.linear_qkv.layer_norm_weight"] = hf[h + "input_layernorm.weight"]
                t[g + "self_attention.linear_qkv.weight"] = part(qkv_full[L], Tm, tm)
                if m.bias:
                    t[g + "self_attention.linear_qkv.bias"] = part(qkv_bias_full[L], Tm, tm)
                if m.qk_norm:
                    t[g + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
                    t[g + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
                if m.moe:
                    t[g + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
                    t[g + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
                else:
                    t[g + "mlp.linear_fc1.layer_norm_weight"] = hf[h + "post_attention_layernorm.weight"]
                    t[g + "mlp.linear_fc1.weight"] = torch.cat([
                        part(hf[h + "mlp.gate_proj.weight"], Tm, tm),
                        part(hf[h + "mlp.up_proj.weight"], Tm, tm)], dim=0)
                    t[g + "mlp.linear_fc2.weight"] = part(hf[h + "mlp.down_proj.weight"], Tm, tm, dim=1)
            if pp == PP - 1:
                t["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
                if not m.tied or PP > 1:  # tied, pp = 1: the logits use the embedding
                    t["output_layer.weight"] = part(out_full, Tm, tm)
            dense[(tm, pp)] = t
    expert = {}
    if m.moe:
        El = m.E // EP
        for pp in range(PP):
            for em in range(EP):
                # contiguous EP blocks: this rank holds experts [em*El, (em+1)*El)
                for te in range(ETP):
                    t = {}
                    for i in range(Lps):
                        L = pp * Lps + i
                        for j in range(El):
                            x = em * El + j
                            h = f"model.layers.{L}.mlp.experts.{x}."
                            g = f"decoder.layers.{i}.mlp.experts."
                            t[f"{g}linear_fc1.weight{j}"] = torch.cat([
                                part(hf[h + "gate_proj.weight"], ETP, te),
                                part(hf[h + "up_proj.weight"], ETP, te)], dim=0)
                            t[f"{g}linear_fc2.weight{j}"] = part(hf[h + "down_proj.weight"], ETP, te, dim=1)
                    expert[(pp, em, te)] = t
    return dense, expert, Vp


# --------------------------------------------------------------------------------------------
# SGLang receiver tensors (LAYOUTS.md §5, §6.1)


def sglang_vocab_part(m, w, Vs, TS, ts):
    padded = torch.cat([w, torch.zeros(Vs - m.V, m.H, dtype=w.dtype)], dim=0)
    return part(padded, TS, ts)


def receiver_shards(m, hf, infer):
    """Returns (recv, Vs) with recv[rank] = {sglang name: tensor}, rank = replica*TS + ts."""
    TS, ES, R = infer["tp"], infer["ep"], infer["replicas"]
    Vs = padded_vocab_sglang(m.V)
    kv_parts = min(TS, m.ng)  # distinct KV slices; each is held by TS/kv_parts ranks
    rep = TS // kv_parts
    one = {}
    for ts in range(TS):
        t = {"model.embed_tokens.weight": sglang_vocab_part(m, hf["model.embed_tokens.weight"], Vs, TS, ts)}
        for L in range(m.L):
            p = f"model.layers.{L}."
            a = p + "self_attn."
            t[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
            t[a + "qkv_proj.weight"] = torch.cat([
                part(hf[a + "q_proj.weight"], TS, ts),
                part(hf[a + "k_proj.weight"], kv_parts, ts // rep),
                part(hf[a + "v_proj.weight"], kv_parts, ts // rep)], dim=0)
            if m.bias:
                t[a + "qkv_proj.bias"] = torch.cat([
                    part(hf[a + "q_proj.bias"], TS, ts),
                    part(hf[a + "k_proj.bias"], kv_parts, ts // rep),
                    part(hf[a + "v_proj.bias"], kv_parts, ts // rep)], dim=0)
            t[a + "o_proj.weight"] = part(hf[a + "o_proj.weight"], TS, ts, dim=1)
            if m.qk_norm:
                t[a + "q_norm.weight"] = hf[a + "q_norm.weight"]
                t[a + "k_norm.weight"] = hf[a + "k_norm.weight"]
            t[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
            if m.moe:
                Ms = TS // ES
                ep_rank, mtp = ts // Ms, ts % Ms
                El = m.E // ES
                t[p + "mlp.gate.weight"] = hf[p + "mlp.gate.weight"]
                w13, w2 = [], []
                for j in range(El):
                    x = ep_rank * El + j
                    h = f"{p}mlp.experts.{x}."
                    w13.append(torch.cat([part(hf[h + "gate_proj.weight"], Ms, mtp),
                                          part(hf[h + "up_proj.weight"], Ms, mtp)], dim=0))
                    w2.append(part(hf[h + "down_proj.weight"], Ms, mtp, dim=1))
                t[p + "mlp.experts.w13_weight"] = torch.stack(w13, dim=0)
                t[p + "mlp.experts.w2_weight"] = torch.stack(w2, dim=0)
            else:
                t[p + "mlp.gate_up_proj.weight"] = torch.cat([
                    part(hf[p + "mlp.gate_proj.weight"], TS, ts),
                    part(hf[p + "mlp.up_proj.weight"], TS, ts)], dim=0)
                t[p + "mlp.down_proj.weight"] = part(hf[p + "mlp.down_proj.weight"], TS, ts, dim=1)
        t["model.norm.weight"] = hf["model.norm.weight"]
        if not m.tied:  # tied: lm_head is embed_tokens, one tensor
            t["lm_head.weight"] = sglang_vocab_part(m, hf["lm_head.weight"], Vs, TS, ts)
        one[ts] = t
    recv = {}
    for r in range(R):
        for ts in range(TS):
            recv[r * TS + ts] = one[ts]
    return recv, Vs


# --------------------------------------------------------------------------------------------
# safetensors container, by hand


def safetensors_bytes(tensors, metadata=None):
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    off = 0
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise AssertionError(f"{name}: dtype {t.dtype}, expected float32")
        b = t.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def write_safetensors(path, tensors, metadata=None):
    data = safetensors_bytes(tensors, metadata)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def read_safetensors(path):
    """Strict reader for the files above: returns ({name: tensor}, metadata)."""
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen % 8:
        raise AssertionError(f"{path}: header length {hlen} is not a multiple of 8")
    raw = data[8:8 + hlen]
    if not raw.startswith(b"{") or not raw.rstrip(b" ").endswith(b"}"):
        raise AssertionError(f"{path}: bad header framing (must be {{...}} padded with spaces)")
    header = json.loads(raw.decode("utf-8"))
    meta = header.pop("__metadata__", {})
    body = memoryview(data)[8 + hlen:]
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    pos = 0
    for b, e, k in spans:
        if b != pos:
            raise AssertionError(f"{path}: tensor {k} starts at {b}, expected {pos}")
        pos = e
    if pos != len(body):
        raise AssertionError(f"{path}: tensors end at {pos}, data section is {len(body)} bytes")
    out = {}
    for k, v in header.items():
        if v["dtype"] != "F32" or set(v) != {"dtype", "shape", "data_offsets"}:
            raise AssertionError(f"{path}: tensor {k} has a bad entry {v}")
        b, e = v["data_offsets"]
        if e - b != 4 * math.prod(v["shape"]):
            raise AssertionError(f"{path}: tensor {k} span {e - b} does not match shape {v['shape']}")
        arr = torch.frombuffer(bytearray(body[b:e]), dtype=torch.float32)
        out[k] = arr.reshape(v["shape"])
    return out, meta


# --------------------------------------------------------------------------------------------
# Driver


def convert(m, train, infer, seed):
    validate(m, train, infer)
    hf = make_hf(m, seed)
    dense, expert, Vp = megatron_shards(m, hf, train)
    recv, Vs = receiver_shards(m, hf, infer)
    return hf, dense, expert, Vp, recv, Vs


def flatten_outputs(m, train, infer, seed, hf, dense, expert, Vp, recv, Vs):
    """The three (tensors, metadata) pairs that go into the files."""
    arch = m.arch
    hf_meta = {"format": "hf", "model": m.name, "architecture": arch, "seed": seed, "V": m.V,
               "config": json.dumps(m.raw, sort_keys=True)}
    meg = {}
    for (tm, pp), t in sorted(dense.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for name, x in t.items():
            meg[f"dense.tp{tm}.pp{pp}.{name}"] = x
    for (pp, em, te), t in sorted(expert.items()):
        for name, x in t.items():
            meg[f"expert.pp{pp}.ep{em}.etp{te}.{name}"] = x
    meg_meta = {"format": "megatron", "model": m.name, "seed": seed, "Vp": Vp, "V": m.V,
                "tp": train["tp"], "pp": train["pp"], "ep": train["ep"], "etp": train["etp"],
                "dp": train["dp"], "layers_per_stage": m.L // train["pp"],
                "experts_per_ep_rank": (m.E // train["ep"]) if m.moe else 0,
                "pad_rows": Vp - m.V,
                "pad_fill": "rows >= V of the padded vocab: float32 bits of +1e30 (embedding) / "
                            "-1e30 (output_layer) plus (row - V) * H + col"}
    rec = {}
    for rank in sorted(recv):
        for name, x in recv[rank].items():
            rec[f"r{rank}.{name}"] = x
    rec_meta = {"format": "sglang", "model": m.name, "seed": seed, "Vs": Vs, "V": m.V,
                "tp": infer["tp"], "ep": infer["ep"], "replicas": infer["replicas"],
                "moe_tp": (infer["tp"] // infer["ep"]) if m.moe else infer["tp"],
                "world": infer["tp"] * infer["replicas"]}
    return (hf, hf_meta), (meg, meg_meta), (rec, rec_meta)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="tiny-qwen3 | tiny-qwen3-moe | path to a config.json")
    ap.add_argument("--train", default="", help="tp=T,pp=P,ep=E,etp=ET,dp=D (missing keys = 1)")
    ap.add_argument("--infer", default="", help="tp=TS,ep=ES,replicas=R (missing keys = 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="output directory (created if absent)")
    ap.add_argument("--selfcheck", action="store_true",
                    help="run the self-check (test_reference_selfcheck.py) and exit")
    args = ap.parse_args(argv)
    if not args.selfcheck and (args.model is None or args.out is None):
        ap.error("--model and --out are required")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.selfcheck:
        sys.dont_write_bytecode = True  # no __pycache__ in the source tree
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import test_reference_selfcheck
        return test_reference_selfcheck.main([])
    try:
        m = load_model(args.model)
        train = parse_topology(args.train, TRAIN_KEYS, "--train")
        infer = parse_topology(args.infer, INFER_KEYS, "--infer")
        validate(m, train, infer)
    except Refused as e:
        print(f"reference_convert.py: refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    hf, dense, expert, Vp, recv, Vs = convert(m, train, infer, args.seed)
    files = flatten_outputs(m, train, infer, args.seed, hf, dense, expert, Vp, recv, Vs)
    os.makedirs(args.out, exist_ok=True)
    for fname, (tensors, meta) in zip(("hf", "megatron", "receivers"), files):
        write_safetensors(os.path.join(args.out, fname + ".safetensors"), tensors, meta)
    print(f"{m.name}: V={m.V} Vp={Vp} Vs={Vs}; hf {len(files[0][0])} tensors, megatron "
          f"{len(files[1][0])}, receivers {len(files[2][0])} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
