#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Self-check of reference_convert.py (run with Debian's /usr/bin/python3, which has torch).

Every check reassembles the HF model by a method different from the one reference_convert.py
uses to shard it, and compares with the original, element for element (all HF values are
distinct, so a misrouted element cannot go unnoticed):

  (a) Megatron: gather all tm shards with torch.cat, undo the QKV group interleave with
      view(ng, qpg+2, d, H), undo the per-rank [gate; up] with view(Tm, 2, F/Tm, H), gather
      experts over the ETP ranks the same way; and, as a third method, compare the gathered QKV
      with the per-row index formula of LAYOUTS.md §5.1 (vectorised).
  (b) SGLang: per replica, concatenate the q parts, take k/v from the first rank of each KV
      replica group (and require the other ranks of the group to hold the same), rebuild the
      experts through SGLang's MoE-EP groups range(mtp, TS, Ms); plus the §5.1 receiver-row
      formula, vectorised.
  (c) names and shapes per rank from the LAYOUTS.md §3.2/§3.4/§6.1 shape formulas.
  (d) cross-side identities stated in LAYOUTS.md §5 (Tm == Ts fc1 == gate_up_proj; T == ng QKV
      identity; Te == Ms, EPm == EPs expert identity).
  (e) the §9 worked examples with Qwen3-8B / Qwen3-30B-A3B head counts, the real vocab size 151936
      and small H, d.
  (f) files: written by main(), read back by a strict reader; refusals exit with status 2.

Grid: tiny-qwen3 and tiny-qwen3-moe x train tp {1,2,4,8} x pp {1,2} x ep {1,2,4} x etp {1,2}
x infer tp {1,2,4,8} x ep {1,2} x replicas {1,2}; dp is the smallest value that makes the
expert-DP size an integer. Combinations that cannot divide are counted as refused.
"""

import contextlib
import io
import itertools
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, HERE)
import reference_convert as rc  # noqa: E402

FAILURES = []


def check(cond, msg):
    if not cond:
        FAILURES.append(msg)
        if len(FAILURES) <= 20:
            print("FAIL:", msg, file=sys.stderr)


def same(a, b, msg):
    ok = tuple(a.shape) == tuple(b.shape) and torch.equal(a, b)
    check(ok, f"{msg}: shapes {tuple(a.shape)} vs {tuple(b.shape)}" if not ok else msg)
    return ok


# ------------------------------------------------------------------------------------------
# (c) expected names and shapes, straight from the LAYOUTS.md shape tables


def expected_megatron_dense(m, train, tm, pp):
    Tm, PP = train["tp"], train["pp"]
    H, d = m.H, m.d
    Vp = rc.padded_vocab_megatron(m.V, Tm)
    out = {}
    if pp == 0:
        out["embedding.word_embeddings.weight"] = (Vp // Tm, H)
    for i in range(m.L // PP):
        g = f"decoder.layers.{i}."
        out[g + "self_attention.linear_qkv.layer_norm_weight"] = (H,)
        out[g + "self_attention.linear_qkv.weight"] = ((m.nq + 2 * m.ng) * d // Tm, H)
        out[g + "self_attention.q_layernorm.weight"] = (d,)
        out[g + "self_attention.k_layernorm.weight"] = (d,)
        out[g + "self_attention.linear_proj.weight"] = (H, m.nq * d // Tm)
        if m.moe:
            out[g + "pre_mlp_layernorm.weight"] = (H,)
            out[g + "mlp.router.weight"] = (m.E, H)
        else:
            out[g + "mlp.linear_fc1.layer_norm_weight"] = (H,)
            out[g + "mlp.linear_fc1.weight"] = (2 * m.F // Tm, H)
            out[g + "mlp.linear_fc2.weight"] = (H, m.F // Tm)
    if pp == PP - 1:
        out["decoder.final_layernorm.weight"] = (H,)
        out["output_layer.weight"] = (Vp // Tm, H)
    return out


def expected_megatron_expert(m, train):
    out = {}
    for i in range(m.L // train["pp"]):
        for j in range(m.E // train["ep"]):
            g = f"decoder.layers.{i}.mlp.experts."
            out[f"{g}linear_fc1.weight{j}"] = (2 * m.Fm // train["etp"], m.H)
            out[f"{g}linear_fc2.weight{j}"] = (m.H, m.Fm // train["etp"])
    return out


def expected_receiver(m, infer):
    TS, ES = infer["tp"], infer["ep"]
    H, d = m.H, m.d
    Vs = rc.padded_vocab_sglang(m.V)
    out = {"model.embed_tokens.weight": (Vs // TS, H)}
    for L in range(m.L):
        p = f"model.layers.{L}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "self_attn.qkv_proj.weight"] = ((m.nq // TS + 2 * max(1, m.ng // TS)) * d, H)
        out[p + "self_attn.o_proj.weight"] = (H, m.nq * d // TS)
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if m.moe:
            Ms = TS // ES
            out[p + "mlp.gate.weight"] = (m.E, H)
            out[p + "mlp.experts.w13_weight"] = (m.E // ES, 2 * m.Fm // Ms, H)
            out[p + "mlp.experts.w2_weight"] = (m.E // ES, H, m.Fm // Ms)
        else:
            out[p + "mlp.gate_up_proj.weight"] = (2 * m.F // TS, H)
            out[p + "mlp.down_proj.weight"] = (H, m.F // TS)
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (Vs // TS, H)
    return out


def check_names_shapes(actual, expected, where):
    got = {k: tuple(v.shape) for k, v in actual.items()}
    if set(got) != set(expected):
        check(False, f"{where}: names differ: missing {sorted(set(expected) - set(got))[:5]}, "
                     f"extra {sorted(set(got) - set(expected))[:5]}")
        return
    bad = [(k, got[k], expected[k]) for k in expected if got[k] != tuple(expected[k])]
    check(not bad, f"{where}: shapes differ: {bad[:5]}")


# ------------------------------------------------------------------------------------------
# §5.1 formulas, vectorised (a third, per-row method)


def hf_qkv_stacked(m, hf, L):
    a = f"model.layers.{L}.self_attn."
    return torch.cat([hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]])


def megatron_row_to_stacked_hf_row(m):
    """For every global Megatron QKV row R, the row in cat([q_proj; k_proj; v_proj])."""
    d, qpg, nq, ng = m.d, m.qpg, m.nq, m.ng
    G = (qpg + 2) * d
    R = torch.arange((nq + 2 * ng) * d)
    g, o = R // G, R % G
    s, j = o // d, o % d
    q_row = (g * qpg + s) * d + j
    k_row = nq * d + g * d + j
    v_row = nq * d + ng * d + g * d + j
    return torch.where(s < qpg, q_row, torch.where(s == qpg, k_row, v_row))


def sglang_row_to_stacked_hf_row(m, TS, ts):
    d, nq, ng = m.d, m.nq, m.ng
    nql = nq // TS * d
    nkl = max(1, ng // TS)
    rep = max(1, TS // ng)
    lrows = torch.arange(nql + 2 * nkl * d)
    q = ts * nql + lrows
    k = nq * d + (ts // rep) * nkl * d + (lrows - nql)
    v = nq * d + ng * d + (ts // rep) * nkl * d + (lrows - nql - nkl * d)
    return torch.where(lrows < nql, q, torch.where(lrows - nql < nkl * d, k, v))


# ------------------------------------------------------------------------------------------
# (a) Megatron -> HF


def check_megatron(m, hf, dense, expert, Vp, train):
    Tm, PP, EP, ETP = train["tp"], train["pp"], train["ep"], train["etp"]
    where = f"{m.name} train {train}"
    H, d = m.H, m.d
    Lps = m.L // PP
    check(Vp % (128 * Tm) == 0 and Vp >= m.V and Vp - m.V < 128 * Tm, f"{where}: Vp={Vp}")
    check(set(dense) == {(tm, pp) for tm in range(Tm) for pp in range(PP)}, f"{where}: dense keys")
    for (tm, pp), t in dense.items():
        check_names_shapes(t, expected_megatron_dense(m, train, tm, pp), f"{where} dense tp{tm} pp{pp}")
    if m.moe:
        check(set(expert) == {(pp, em, te) for pp in range(PP) for em in range(EP)
                              for te in range(ETP)}, f"{where}: expert keys")
        for key, t in expert.items():
            check_names_shapes(t, expected_megatron_expert(m, train), f"{where} expert {key}")
    else:
        check(not expert, f"{where}: dense model has expert params")

    def gather(name, pp, dim):
        return torch.cat([dense[(tm, pp)][name] for tm in range(Tm)], dim=dim)

    def replicated(name, pp, ref, what):
        for tm in range(Tm):
            same(dense[(tm, pp)][name], ref, f"{where}: {what} tp{tm} pp{pp}")

    emb = gather("embedding.word_embeddings.weight", 0, 0)
    out = gather("output_layer.weight", PP - 1, 0)
    for full, hname, sign in ((emb, "model.embed_tokens.weight", 1), (out, "lm_head.weight", -1)):
        same(full[:m.V], hf[hname], f"{where}: {hname} rows < V")
        pad = full[m.V:]
        check(pad.shape[0] == Vp - m.V, f"{where}: pad rows")
        check(bool((pad * sign >= 1e30).all()), f"{where}: {hname} padding is not the junk value")
        check(torch.unique(pad).numel() == pad.numel(), f"{where}: junk values not distinct")
    replicated("decoder.final_layernorm.weight", PP - 1, hf["model.norm.weight"], "final norm")

    row_map = megatron_row_to_stacked_hf_row(m)
    Lq = (m.nq + 2 * m.ng) * d // Tm
    for L in range(m.L):
        pp, i = divmod(L, Lps)
        h, g = f"model.layers.{L}.", f"decoder.layers.{i}."
        full = gather(g + "self_attention.linear_qkv.weight", pp, 0)
        grp = full.view(m.ng, m.qpg + 2, d, H)
        same(grp[:, :m.qpg].reshape(m.nq * d, H), hf[h + "self_attn.q_proj.weight"], f"{where}: L{L} q")
        same(grp[:, m.qpg].reshape(m.ng * d, H), hf[h + "self_attn.k_proj.weight"], f"{where}: L{L} k")
        same(grp[:, m.qpg + 1].reshape(m.ng * d, H), hf[h + "self_attn.v_proj.weight"], f"{where}: L{L} v")
        stacked = hf_qkv_stacked(m, hf, L)
        for tm in range(Tm):  # §5.1: rank tm local row l <-> global R = tm*Lq + l
            local = dense[(tm, pp)][g + "self_attention.linear_qkv.weight"]
            same(local, stacked[row_map[tm * Lq:(tm + 1) * Lq]], f"{where}: L{L} qkv formula tp{tm}")
        same(gather(g + "self_attention.linear_proj.weight", pp, 1), hf[h + "self_attn.o_proj.weight"],
             f"{where}: L{L} o_proj")
        replicated(g + "self_attention.linear_qkv.layer_norm_weight", pp, hf[h + "input_layernorm.weight"],
                   f"L{L} input norm")
        replicated(g + "self_attention.q_layernorm.weight", pp, hf[h + "self_attn.q_norm.weight"], f"L{L} q_norm")
        replicated(g + "self_attention.k_layernorm.weight", pp, hf[h + "self_attn.k_norm.weight"], f"L{L} k_norm")
        if m.moe:
            replicated(g + "pre_mlp_layernorm.weight", pp, hf[h + "post_attention_layernorm.weight"],
                       f"L{L} post-attn norm")
            replicated(g + "mlp.router.weight", pp, hf[h + "mlp.gate.weight"], f"L{L} router")
            El = m.E // EP
            for em in range(EP):
                fc1 = torch.stack([torch.stack([expert[(pp, em, te)][f"{g}mlp.experts.linear_fc1.weight{j}"]
                                                for te in range(ETP)]) for j in range(El)])
                fc1 = fc1.view(El, ETP, 2, m.Fm // ETP, H)
                fc2 = torch.cat([torch.stack([expert[(pp, em, te)][f"{g}mlp.experts.linear_fc2.weight{j}"]
                                              for j in range(El)]) for te in range(ETP)], dim=2)
                for j in range(El):
                    x = em * El + j
                    e = f"{h}mlp.experts.{x}."
                    same(fc1[j, :, 0].reshape(m.Fm, H), hf[e + "gate_proj.weight"], f"{where}: L{L} e{x} gate")
                    same(fc1[j, :, 1].reshape(m.Fm, H), hf[e + "up_proj.weight"], f"{where}: L{L} e{x} up")
                    same(fc2[j], hf[e + "down_proj.weight"], f"{where}: L{L} e{x} down")
        else:
            replicated(g + "mlp.linear_fc1.layer_norm_weight", pp, hf[h + "post_attention_layernorm.weight"],
                       f"L{L} post-attn norm")
            fc1 = torch.stack([dense[(tm, pp)][g + "mlp.linear_fc1.weight"] for tm in range(Tm)])
            fc1 = fc1.view(Tm, 2, m.F // Tm, H)
            same(fc1[:, 0].reshape(m.F, H), hf[h + "mlp.gate_proj.weight"], f"{where}: L{L} gate")
            same(fc1[:, 1].reshape(m.F, H), hf[h + "mlp.up_proj.weight"], f"{where}: L{L} up")
            same(gather(g + "mlp.linear_fc2.weight", pp, 1), hf[h + "mlp.down_proj.weight"], f"{where}: L{L} down")


# ------------------------------------------------------------------------------------------
# (b) SGLang receivers -> HF


def check_receivers(m, hf, recv, Vs, infer):
    TS, ES, R = infer["tp"], infer["ep"], infer["replicas"]
    where = f"{m.name} infer {infer}"
    H, d = m.H, m.d
    check(Vs % 64 == 0 and m.V <= Vs < m.V + 64, f"{where}: Vs={Vs}")
    check(set(recv) == set(range(TS * R)), f"{where}: receiver ranks {sorted(recv)[:8]}")
    exp = expected_receiver(m, infer)
    for rank, t in recv.items():
        check_names_shapes(t, exp, f"{where} r{rank}")
    nql = m.nq // TS * d
    nkl = max(1, m.ng // TS)
    for rep_i in range(R):
        ranks = [rep_i * TS + ts for ts in range(TS)]
        rk = [recv[r] for r in ranks]
        if rep_i > 0:
            for ts in range(TS):
                for name, x in recv[ts].items():
                    if not torch.equal(rk[ts][name], x):
                        check(False, f"{where}: replica {rep_i} rank {ranks[ts]} {name} differs from replica 0")
        for hname in ("model.embed_tokens.weight", "lm_head.weight"):
            full = torch.cat([t[hname] for t in rk])
            same(full[:m.V], hf[hname], f"{where}: replica {rep_i} {hname}")
            check(bool((full[m.V:] == 0).all()) and full.shape[0] == Vs, f"{where}: {hname} tail not zero")
        for t in rk:
            same(t["model.norm.weight"], hf["model.norm.weight"], f"{where}: model.norm")
        for L in range(m.L):
            p = f"model.layers.{L}."
            a = p + "self_attn."
            parts = [torch.split(t[a + "qkv_proj.weight"], [nql, nkl * d, nkl * d]) for t in rk]
            same(torch.cat([q for q, _, _ in parts]), hf[a + "q_proj.weight"], f"{where}: L{L} q")
            if TS > m.ng:
                rep = TS // m.ng
                firsts = list(range(0, TS, rep))
                for ts in range(TS):  # every rank of a KV replica group holds its first rank's k/v
                    lead = parts[ts - ts % rep]
                    check(torch.equal(parts[ts][1], lead[1]) and torch.equal(parts[ts][2], lead[2]),
                          f"{where}: L{L} rank {ts} kv differs from its replica group")
            else:
                firsts = list(range(TS))
            same(torch.cat([parts[ts][1] for ts in firsts]), hf[a + "k_proj.weight"], f"{where}: L{L} k")
            same(torch.cat([parts[ts][2] for ts in firsts]), hf[a + "v_proj.weight"], f"{where}: L{L} v")
            stacked = hf_qkv_stacked(m, hf, L)
            for ts in range(TS):
                same(rk[ts][a + "qkv_proj.weight"], stacked[sglang_row_to_stacked_hf_row(m, TS, ts)],
                     f"{where}: L{L} qkv formula ts{ts}")
            same(torch.cat([t[a + "o_proj.weight"] for t in rk], dim=1), hf[a + "o_proj.weight"],
                 f"{where}: L{L} o_proj")
            for t in rk:
                same(t[p + "input_layernorm.weight"], hf[p + "input_layernorm.weight"], f"{where}: L{L} in-norm")
                same(t[p + "post_attention_layernorm.weight"], hf[p + "post_attention_layernorm.weight"],
                     f"{where}: L{L} post-norm")
                same(t[a + "q_norm.weight"], hf[a + "q_norm.weight"], f"{where}: L{L} q_norm")
                same(t[a + "k_norm.weight"], hf[a + "k_norm.weight"], f"{where}: L{L} k_norm")
            if m.moe:
                Ms = TS // ES
                El = m.E // ES
                for t in rk:
                    same(t[p + "mlp.gate.weight"], hf[p + "mlp.gate.weight"], f"{where}: L{L} router")
                # SGLang MoE-EP groups are range(mtp, TS, Ms); the ep rank is the position in it.
                gate = [[None] * Ms for _ in range(m.E)]
                up = [[None] * Ms for _ in range(m.E)]
                down = [[None] * Ms for _ in range(m.E)]
                for mtp in range(Ms):
                    for ep_rank, ts in enumerate(range(mtp, TS, Ms)):
                        w13 = rk[ts][p + "mlp.experts.w13_weight"].view(El, 2, m.Fm // Ms, H)
                        w2 = rk[ts][p + "mlp.experts.w2_weight"]
                        for j in range(El):
                            x = ep_rank * El + j
                            gate[x][mtp], up[x][mtp], down[x][mtp] = w13[j, 0], w13[j, 1], w2[j]
                for x in range(m.E):
                    e = f"{p}mlp.experts.{x}."
                    same(torch.cat(gate[x]), hf[e + "gate_proj.weight"], f"{where}: L{L} e{x} gate")
                    same(torch.cat(up[x]), hf[e + "up_proj.weight"], f"{where}: L{L} e{x} up")
                    same(torch.cat(down[x], dim=1), hf[e + "down_proj.weight"], f"{where}: L{L} e{x} down")
            else:
                gu = torch.stack([t[p + "mlp.gate_up_proj.weight"] for t in rk]).view(TS, 2, m.F // TS, H)
                same(gu[:, 0].reshape(m.F, H), hf[p + "mlp.gate_proj.weight"], f"{where}: L{L} gate")
                same(gu[:, 1].reshape(m.F, H), hf[p + "mlp.up_proj.weight"], f"{where}: L{L} up")
                same(torch.cat([t[p + "mlp.down_proj.weight"] for t in rk], dim=1),
                     hf[p + "mlp.down_proj.weight"], f"{where}: L{L} down")


# ------------------------------------------------------------------------------------------
# (d) cross-side identities from LAYOUTS.md §5


def check_identities(m, dense, expert, recv, train, infer):
    where = f"{m.name} train {train} infer {infer}"
    Tm, TS, PP = train["tp"], infer["tp"], train["pp"]
    Lps = m.L // PP
    for L in range(m.L):
        pp, i = divmod(L, Lps)
        g, p = f"decoder.layers.{i}.", f"model.layers.{L}."
        if Tm == TS:
            for t in range(TS):
                if not m.moe:
                    same(dense[(t, pp)][g + "mlp.linear_fc1.weight"], recv[t][p + "mlp.gate_up_proj.weight"],
                         f"{where}: §5.2 fc1 == gate_up_proj L{L} t{t}")
                same(dense[(t, pp)][g + "self_attention.linear_proj.weight"], recv[t][p + "self_attn.o_proj.weight"],
                     f"{where}: linear_proj == o_proj L{L} t{t}")
                if TS == m.ng:
                    same(dense[(t, pp)][g + "self_attention.linear_qkv.weight"], recv[t][p + "self_attn.qkv_proj.weight"],
                         f"{where}: §5.1 T == ng QKV identity L{L} t{t}")
        if m.moe and train["etp"] == TS // infer["ep"] and train["ep"] == infer["ep"]:
            Ms = TS // infer["ep"]
            for ts in range(TS):
                em, te = ts // Ms, ts % Ms
                w13 = recv[ts][p + "mlp.experts.w13_weight"]
                w2 = recv[ts][p + "mlp.experts.w2_weight"]
                for j in range(m.E // infer["ep"]):
                    same(w13[j], expert[(pp, em, te)][f"{g}mlp.experts.linear_fc1.weight{j}"],
                         f"{where}: §5.5 w13 == fc1 L{L} ts{ts} j{j}")
                    same(w2[j], expert[(pp, em, te)][f"{g}mlp.experts.linear_fc2.weight{j}"],
                         f"{where}: §5.5 w2 == fc2 L{L} ts{ts} j{j}")


# ------------------------------------------------------------------------------------------
# (e) LAYOUTS.md §9 worked examples


def check_worked_examples():
    # Qwen3-8B: nq=32, ng=8, V=151936; small H, d, F (F is a multiple of 4, as 12288 is).
    d, H, F = 4, 8, 48
    m = rc.Model({"architectures": ["Qwen3ForCausalLM"], "hidden_size": H, "num_hidden_layers": 1,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": d,
                  "intermediate_size": F, "vocab_size": 151936}, "qwen3-8b-shaped")
    train = {"tp": 4, "pp": 1, "ep": 1, "etp": 1, "dp": 1}
    infer = {"tp": 2, "ep": 1, "replicas": 1}
    rc.validate(m, train, infer)
    hf, dense, expert, Vp, recv, Vs = rc.convert(m, train, infer, seed=8)
    a = "model.layers.0.self_attn."
    q, k, v = hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]

    def head(w, h):
        return w[h * d:(h + 1) * d]

    meg1 = dense[(1, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
    check(tuple(meg1.shape) == (2 * 6 * d, H), f"§9 8B: Megatron qkv rank shape {tuple(meg1.shape)}")
    want = torch.cat([head(q, h) for h in range(8, 12)] + [head(k, 2), head(v, 2)] +
                     [head(q, h) for h in range(12, 16)] + [head(k, 3), head(v, 3)])
    same(meg1, want, "§9 8B: Megatron TP=4 rank 1 = [q8-11,k2,v2,q12-15,k3,v3]")
    s0 = recv[0][a + "qkv_proj.weight"]
    want = torch.cat([q[0:16 * d], k[0:4 * d], v[0:4 * d]])
    same(s0, want, "§9 8B: SGLang TS=2 rank 0 qkv_proj = [q 0-15; k 0-3; v 0-3]")
    check(tuple(s0.shape) == ((16 + 8) * d, H), "§9 8B: SGLang qkv shape")
    # built from Megatron ranks 0 and 1 only (a row permutation of their union)
    m01 = torch.cat([dense[(t, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"] for t in (0, 1)])
    same(torch.sort(s0.flatten()).values, torch.sort(m01.flatten()).values,
         "§9 8B: SGLang rank 0 qkv is a permutation of Megatron ranks 0,1")
    f = F // 4
    r0 = dense[(0, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
    r1 = dense[(1, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
    same(recv[0]["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([r0[:f], r1[:f], r0[f:], r1[f:]]),
         "§9 8B: gate_up_proj rank 0 = [r0 gate; r1 gate; r0 up; r1 up]")
    check(Vp == 152064, f"§9 8B: Vp = {Vp}, expected 152064")
    e0 = dense[(0, 0)]["embedding.word_embeddings.weight"]
    e1 = dense[(1, 0)]["embedding.word_embeddings.weight"]
    check(e0.shape[0] == 38016, f"§9 8B: Megatron rows per rank {e0.shape[0]}")
    s_e0 = recv[0]["model.embed_tokens.weight"]
    s_e1 = recv[1]["model.embed_tokens.weight"]
    check(s_e0.shape[0] == 75968, f"§9 8B: SGLang rows per rank {s_e0.shape[0]}")
    same(s_e0, torch.cat([e0, e1[:37952]]), "§9 8B: SGLang rank 0 embed = Megatron r0 + r1[0:37952]")
    same(e1[37952:], s_e1[:64], "§9 8B: Megatron r1 rows 37952-38015 = SGLang r1 rows 0-63")
    check_megatron(m, hf, dense, expert, Vp, train)
    check_receivers(m, hf, recv, Vs, infer)

    # Qwen3-30B-A3B: nq=32, ng=4, E=128; Megatron TP=4 ETP=1 EP=8 -> SGLang TP=8 EP=8 (Ms=1).
    m = rc.Model({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": H, "num_hidden_layers": 1,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": d,
                  "moe_intermediate_size": 4, "num_experts": 128, "num_experts_per_tok": 8,
                  "intermediate_size": 48, "vocab_size": 1000}, "qwen3-30b-a3b-shaped")
    train = {"tp": 4, "pp": 1, "ep": 8, "etp": 1, "dp": 2}
    infer = {"tp": 8, "ep": 8, "replicas": 1}
    rc.validate(m, train, infer)
    hf, dense, expert, Vp, recv, Vs = rc.convert(m, train, infer, seed=30)
    for t in range(8):
        mq = dense[(t // 2, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
        check(mq.shape[0] == 10 * d, "§9 30B: one group per Megatron rank")
        want = torch.cat([mq[(t % 2) * 4 * d:(t % 2 + 1) * 4 * d], mq[8 * d:9 * d], mq[9 * d:10 * d]])
        same(recv[t][a + "qkv_proj.weight"], want, f"§9 30B: SGLang rank {t} qkv from Megatron rank {t // 2}")
        w13 = recv[t]["model.layers.0.mlp.experts.w13_weight"]
        w2 = recv[t]["model.layers.0.mlp.experts.w2_weight"]
        check(w13.shape[0] == 16, "§9 30B: 16 experts per rank")
        for i in range(16):
            same(w13[i], expert[(0, t, 0)][f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}"],
                 f"§9 30B: w13[{i}] == fc1.weight{i} rank {t}")
            same(w2[i], expert[(0, t, 0)][f"decoder.layers.0.mlp.experts.linear_fc2.weight{i}"],
                 f"§9 30B: w2[{i}] == fc2.weight{i} rank {t}")
    check_megatron(m, hf, dense, expert, Vp, train)
    check_receivers(m, hf, recv, Vs, infer)


# ------------------------------------------------------------------------------------------
# (f) files and refusals


def check_files(model_name, train, infer, seed, tmp):
    args = ["--model", model_name, "--seed", str(seed), "--out", tmp,
            "--train", ",".join(f"{k}={v}" for k, v in train.items()),
            "--infer", ",".join(f"{k}={v}" for k, v in infer.items())]
    with contextlib.redirect_stdout(io.StringIO()):
        status = rc.main(args)
    check(status == 0, f"main({args}) failed")
    m = rc.load_model(model_name)
    hf, dense, expert, Vp, recv, Vs = rc.convert(m, train, infer, seed)
    files = rc.flatten_outputs(m, train, infer, seed, hf, dense, expert, Vp, recv, Vs)
    for fname, (tensors, meta) in zip(("hf", "megatron", "receivers"), files):
        path = os.path.join(tmp, fname + ".safetensors")
        with open(path, "rb") as fh:
            hlen = int.from_bytes(fh.read(8), "little")
        check((8 + hlen) % 8 == 0, f"{path}: data section not 8-aligned")
        got, gmeta = rc.read_safetensors(path)
        check(list(got) == list(tensors), f"{path}: tensor names/order differ")
        for name, x in tensors.items():
            if name in got and not torch.equal(got[name], x):
                check(False, f"{path}: {name} differs after the file round trip")
        check(all(isinstance(v, str) for v in gmeta.values()), f"{path}: metadata not strings")
        check(gmeta == {k: str(v) for k, v in meta.items()}, f"{path}: metadata differs")
    _, gmeta = rc.read_safetensors(os.path.join(tmp, "megatron.safetensors"))
    check(gmeta["Vp"] == str(Vp), "megatron metadata Vp")
    _, gmeta = rc.read_safetensors(os.path.join(tmp, "receivers.safetensors"))
    check(gmeta["Vs"] == str(Vs), "receivers metadata Vs")
    # names in the files follow the brief's scheme
    meg, _ = rc.read_safetensors(os.path.join(tmp, "megatron.safetensors"))
    check("dense.tp0.pp0.embedding.word_embeddings.weight" in meg, "megatron file: embedding name")
    if m.moe:
        check("expert.pp0.ep0.etp0.decoder.layers.0.mlp.experts.linear_fc1.weight0" in meg,
              "megatron file: expert name")


REFUSALS = [
    # (model, train, infer, words that must appear in the message)
    ("tiny-qwen3", {"tp": 3}, {}, ["num_attention_heads", "Tm=3"]),
    ("tiny-qwen3", {"tp": 16}, {}, ["num_attention_heads", "nq=8", "Tm=16"]),
    ("tiny-qwen3", {"pp": 3}, {}, ["num_hidden_layers", "PP=3"]),
    ("tiny-qwen3", {}, {"tp": 16}, ["num_attention_heads", "TS=16"]),
    ("tiny-qwen3-moe", {"ep": 3}, {}, ["num_experts", "EP=3"]),
    ("tiny-qwen3-moe", {"etp": 32, "dp": 32}, {}, ["moe_intermediate_size", "ETP=32"]),
    ("tiny-qwen3-moe", {"ep": 2}, {}, ["etp*ep", "dp"]),
    ("tiny-qwen3-moe", {}, {"ep": 3}, ["num_experts", "ES=3"]),
    ("tiny-qwen3-moe", {}, {"tp": 2, "ep": 4}, ["infer tp", "ES=4"]),
    ("tiny-qwen3-moe", {}, {"tp": 8, "ep": 8, }, []),  # valid: Ms = 1
]


def check_refusals():
    ng3 = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 12,
           "vocab_size": 100}
    fm = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "moe_intermediate_size": 6, "num_experts": 4, "vocab_size": 100}
    # head_dim absent and H % nq != 0 is refused as a config error
    try:
        rc.Model(ng3, "ng3")
        check(False, "head_dim default with H % nq != 0 must be refused")
    except rc.Refused as e:
        check("head_dim" in str(e), f"head_dim message: {e}")
    ng3 = dict(ng3, head_dim=4)
    ng3v = dict(ng3, vocab_size=190)  # Vs = 192 = 2^6 * 3
    extra = [  # non-power-of-two shapes; words == [] means valid (then fully checked)
        (ng3, {}, {"tp": 2}, ["num_key_value_heads", "ng=3", "TS=2"]),
        (ng3, {}, {"tp": 3}, ["padded vocab", "Vs=128", "TS=3"]),
        (ng3v, {"tp": 3, "pp": 2}, {"tp": 3}, []),
        (ng3v, {"tp": 6}, {"tp": 6, "replicas": 2}, []),  # Tm > ng: half a group per rank; KV x2
        (ng3v, {"tp": 2}, {}, []),  # Tm=2 < ng=3: rank boundary inside group 1
        (fm, {}, {"tp": 4, "ep": 1}, ["moe_intermediate_size", "Ms"]),
        (fm, {"tp": 4, "etp": 3, "dp": 3}, {"tp": 2, "ep": 2}, []),
        (fm, {"tp": 2, "ep": 2, "etp": 2, "dp": 2}, {"tp": 4, "ep": 2}, []),
        (fm, {"tp": 4, "etp": 4}, {}, ["moe_intermediate_size", "ETP=4"]),
    ]
    n = 0
    for model, train, infer, words in REFUSALS:
        m = rc.load_model(model)
        tr = dict({k: 1 for k in rc.TRAIN_KEYS}, **train)
        inf = dict({k: 1 for k in rc.INFER_KEYS}, **infer)
        try:
            rc.validate(m, tr, inf)
            check(not words, f"refusal expected for {model} {tr} {inf}")
        except rc.Refused as e:
            check(bool(words) and all(w in str(e) for w in words),
                  f"{model} {tr} {inf}: message {str(e)!r} lacks {words}")
        n += 1
    for cfg, train, infer, words in extra:
        m = rc.Model(cfg, "x")
        tr = dict({k: 1 for k in rc.TRAIN_KEYS}, **train)
        inf = dict({k: 1 for k in rc.INFER_KEYS}, **infer)
        try:
            rc.validate(m, tr, inf)
            check(not words, f"refusal expected for {cfg} {tr} {inf}")
            hf, dense, expert, Vp, recv, Vs = rc.convert(m, tr, inf, 5)
            check_megatron(m, hf, dense, expert, Vp, tr)
            check_receivers(m, hf, recv, Vs, inf)
        except rc.Refused as e:
            check(bool(words) and all(w in str(e) for w in words), f"{tr} {inf}: message {str(e)!r} lacks {words}")
        n += 1
    # the process exit status, once each way
    script = os.path.join(HERE, "reference_convert.py")
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([sys.executable, script, "--model", "tiny-qwen3", "--train", "tp=3",
                            "--out", tmp], capture_output=True, text=True)
        check(p.returncode == 2 and "num_attention_heads" in p.stderr and "Tm=3" in p.stderr,
              f"exit status {p.returncode}, stderr {p.stderr!r}")
        p = subprocess.run([sys.executable, script, "--model", "tiny-qwen3-moe", "--train",
                            "tp=2,pp=2,ep=4,etp=2,dp=4", "--infer", "tp=8,ep=2,replicas=2",
                            "--seed", "3", "--out", tmp], capture_output=True, text=True)
        check(p.returncode == 0, f"exit status {p.returncode}, stderr {p.stderr!r}")
        check(sorted(os.listdir(tmp)) == ["hf.safetensors", "megatron.safetensors", "receivers.safetensors"],
              f"output files {os.listdir(tmp)}")
    return n + 2


# ------------------------------------------------------------------------------------------


def min_dp(train):
    ee = train["etp"] * train["ep"]
    return ee // math.gcd(train["tp"], ee)


def main(argv=None):
    t0 = time.time()
    stats = {}
    seeds = {"tiny-qwen3": 11, "tiny-qwen3-moe": 12}
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in ("tiny-qwen3", "tiny-qwen3-moe"):
            m = rc.load_model(model_name)
            seed = seeds[model_name]
            hf = rc.make_hf(m, seed)
            again = rc.make_hf(m, seed)
            other = rc.make_hf(m, seed + 1)
            check(all(torch.equal(hf[k], again[k]) for k in hf), f"{model_name}: seed not reproducible")
            check(not torch.equal(hf["lm_head.weight"], other["lm_head.weight"]), f"{model_name}: seed ignored")
            allv = torch.cat([x.flatten() for x in hf.values()])
            check(torch.unique(allv).numel() == allv.numel(), f"{model_name}: HF values not distinct")
            check_names_shapes(hf, dict(rc.hf_shapes(m)), f"{model_name} hf")

            moe_axes = ([1, 2, 4], [1, 2]) if m.moe else ([1], [1])
            trains = [dict(tp=tp, pp=pp, ep=ep, etp=etp)
                      for tp, pp, ep, etp in itertools.product([1, 2, 4, 8], [1, 2], *moe_axes)]
            infers = [dict(tp=ts, ep=es, replicas=r)
                      for ts, es, r in itertools.product([1, 2, 4, 8], [1, 2] if m.moe else [1], [1, 2])]
            for t in trains:
                t["dp"] = min_dp(t)
            good_train, good_infer = {}, {}
            ok = refused = 0
            sample = []
            base_train = {k: 1 for k in rc.TRAIN_KEYS}
            base_infer = {k: 1 for k in rc.INFER_KEYS}
            for tr, inf in itertools.product(trains, infers):
                try:
                    rc.validate(m, tr, inf)
                except rc.Refused:
                    refused += 1
                    continue
                ok += 1
                kt, ki = tuple(tr.values()), tuple(inf.values())
                if kt not in good_train:
                    dense, expert, Vp = rc.megatron_shards(m, hf, tr)
                    check_megatron(m, hf, dense, expert, Vp, tr)
                    good_train[kt] = (dense, expert)
                if ki not in good_infer:
                    recv, Vs = rc.receiver_shards(m, hf, inf)
                    check_receivers(m, hf, recv, Vs, inf)
                    good_infer[ki] = recv
                if inf["replicas"] == 1:
                    dense, expert = good_train[kt]
                    check_identities(m, dense, expert, good_infer[ki], tr, inf)
                if (ok % 17) == 1:
                    sample.append((tr, inf))
            # each side alone must be refused only by its own constraints: every train topology
            # of the grid that passes with the trivial inference side has been checked, and so on
            for tr in trains:
                try:
                    rc.validate(m, tr, base_infer)
                    check(tuple(tr.values()) in good_train, f"{model_name}: train {tr} never checked")
                except rc.Refused:
                    pass
            for inf in infers:
                try:
                    rc.validate(m, dict(base_train, dp=1), inf)
                    check(tuple(inf.values()) in good_infer, f"{model_name}: infer {inf} never checked")
                except rc.Refused:
                    pass
            for tr, inf in sample:
                check_files(model_name, tr, inf, seed, tmp)
            stats[model_name] = (ok, refused, len(good_train), len(good_infer), len(sample))
        check_worked_examples()
        n_ref = check_refusals()
    dt = time.time() - t0
    for name, (ok, refused, nt, ni, ns) in stats.items():
        print(f"{name}: {ok} valid combinations ({refused} refused); {nt} train and {ni} infer "
              f"topologies reassembled; {ns} written to files and read back")
    print(f"worked examples (§9): Qwen3-8B-shaped TP=4 -> TS=2, Qwen3-30B-A3B-shaped "
          f"TP=4/EP=8 -> TS=8/EP=8; refusal cases: {n_ref}")
    if FAILURES:
        print(f"SELF-CHECK FAILED: {len(FAILURES)} failures ({dt:.1f} s)")
        return 1
    print(f"SELF-CHECK PASSED ({dt:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
