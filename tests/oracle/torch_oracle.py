#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Oracle data for dte's optimizer inverses, produced by the real torch.optim optimizers.

For one named setting, runs torch.optim.AdamW / Adam (L2 weight decay) / SGD (momentum) for
--steps steps on --elements weight-like elements with heavy-tailed gradients, and writes one
safetensors file holding every step's true weights and the optimizer state after it:

  theta.0 ... theta.S               F32 [N]   weights before step 1, after step s
  exp_avg.s, exp_avg_sq.s           F32 [N]   Adam state after step s        (adamw, adam)
  momentum_buffer.s                 F32 [N]   SGD momentum buffer after step s (sgd)
  __metadata__: optimizer, steps, weight_decay, beta1, beta2, eps, momentum, dampening,
                lr.s and step.s for every step (exact decimal strings)

--audit-file PATH instead writes a single step in the `dte audit-inverse` format (theta_prev,
theta and the state tensors, scalar metadata).

Only torch is needed (Debian's python3-torch). The safetensors container is written by hand
(8-byte little-endian header length, JSON header, raw little-endian data), independently of
dte's own writer, so the C++ reader is tested against bytes it did not produce.
"""

import argparse
import json
import math
import os
import struct
import sys

import torch

# name: (optimizer, constructor kwargs, lr schedule kind[, data]); data is "natural" (the
# default: weight-like values, heavy-tailed gradients) or "dead" (dead units, see dead_units()).
SETTINGS = {
    # AdamW over the grid: lr 1e-6..1e-4, weight decay 0..0.1, eps 1e-8 and 1e-6.
    "adamw_lr1e-6_wd0_eps1e-8": ("adamw", dict(lr=1e-6, weight_decay=0.0, eps=1e-8), "constant"),
    "adamw_lr1e-5_wd0.01_eps1e-8": ("adamw", dict(lr=1e-5, weight_decay=0.01, eps=1e-8), "constant"),
    "adamw_lr1e-4_wd0.1_eps1e-6": ("adamw", dict(lr=1e-4, weight_decay=0.1, eps=1e-6), "constant"),
    "adamw_warmup_cosine_wd0.1_eps1e-8_foreach": (
        "adamw", dict(lr=1e-4, weight_decay=0.1, eps=1e-8, foreach=True), "warmup_cosine"),
    "adamw_lr1e-6_wd0.1_eps1e-6": (
        "adamw", dict(lr=1e-6, weight_decay=0.1, eps=1e-6), "constant"),
    # torch.optim.Adam with L2 weight decay folded into the gradient.
    "adam_l2_lr1e-5_wd0.01": ("adam", dict(lr=1e-5, weight_decay=0.01, eps=1e-8), "constant"),
    "adam_l2_lr1e-4_wd0.1_eps1e-6": ("adam", dict(lr=1e-4, weight_decay=0.1, eps=1e-6), "constant"),
    # torch.optim.SGD with a momentum buffer.
    "sgd_momentum_lr1e-3_damp0.1_wd1e-4": (
        "sgd", dict(lr=1e-3, momentum=0.9, dampening=0.1, weight_decay=1e-4), "constant"),
    "sgd_momentum_lr1e-2": ("sgd", dict(lr=1e-2, momentum=0.9), "constant"),
    # Dead units: weights 1e-37..1e-30 whose gradients (1e-40..1e-36) underflow exp_avg_sq to 0,
    # so the denominator is eps and torch's step_size * exp_avg underflows before the division.
    "adamw_dead_units_lr1e-6_wd0.1": (
        "adamw", dict(lr=1e-6, weight_decay=0.1, eps=1e-8), "constant", "dead"),
    "adamw_dead_units_warmup_cosine_foreach": (
        "adamw", dict(lr=1e-4, weight_decay=0.1, eps=1e-8, foreach=True), "warmup_cosine", "dead"),
    "adam_l2_dead_units_lr1e-5": (
        "adam", dict(lr=1e-5, weight_decay=0.01, eps=1e-8), "constant", "dead"),
    "sgd_dead_units_lr1e-2": ("sgd", dict(lr=1e-2, momentum=0.9), "constant", "dead"),
}


def weight_like(n, gen):
    """N(0, 0.02) matrices, norm weights near 1, exact zeros, tiny magnitudes, larger values."""
    kind = torch.rand(n, generator=gen)
    z = torch.randn(n, generator=gen)
    w = 0.02 * z
    w = torch.where((kind >= 0.70) & (kind < 0.85), 1.0 + 0.02 * z, w)  # norm-like
    w = torch.where((kind >= 0.85) & (kind < 0.90), torch.zeros_like(w), w)  # exact zeros
    w = torch.where((kind >= 0.90) & (kind < 0.95), 1e-30 * z, w)  # tiny magnitudes
    w = torch.where(kind >= 0.95, 0.2 * z, w)  # embeddings / outliers
    return w.float()


def dead_units(n, gen):
    """40% weight-like values, 50% dead units (|w| log-uniform over 1e-37..1e-30, gradient scale
    log-uniform over 1e-40..1e-36) and 10% zero weights of either sign that never get a gradient.
    Returns (weights, per-element gradient scale, never-updated mask)."""
    kind = torch.rand(n, generator=gen)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    natural = weight_like(n, gen)
    tiny = sign * torch.pow(10.0, -37.0 + 7.0 * torch.rand(n, generator=gen, dtype=torch.float64))
    dead_scale = torch.pow(10.0, -40.0 + 4.0 * torch.rand(n, generator=gen, dtype=torch.float64))
    scale, never = gradient_scales(n, gen)
    is_dead = (kind >= 0.40) & (kind < 0.90)
    is_zero = kind >= 0.90
    w = torch.where(is_dead, tiny.float(), natural)
    w = torch.where(is_zero, (sign * 0.0).float(), w)  # +0 and -0
    scale = torch.where(is_dead, dead_scale.float(), scale)
    never = never | is_zero
    return w, scale, never


def gradient_scales(n, gen):
    """Per-element scale: log-uniform over 1e-7..1e-2, 2% of elements never get a gradient."""
    scale = torch.pow(10.0, -7.0 + 5.0 * torch.rand(n, generator=gen, dtype=torch.float64))
    dead = torch.rand(n, generator=gen) < 0.02
    return scale.float(), dead


def heavy_tailed(n, gen):
    """Student-t with 2 degrees of freedom: finite mean, infinite variance."""
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    chi2 = torch.randn(n, generator=gen, dtype=torch.float64) ** 2 + \
        torch.randn(n, generator=gen, dtype=torch.float64) ** 2
    return (z / torch.sqrt(chi2 / 2.0)).float()


def lr_at(schedule, base_lr, step, steps):
    if schedule == "constant":
        return base_lr
    warmup = max(1, steps // 5)
    lo = 1e-6
    if step <= warmup:
        return lo + (base_lr - lo) * step / warmup
    r = (step - warmup) / max(1, steps - warmup)
    return lo + 0.5 * (math.cos(math.pi * r) + 1.0) * (base_lr - lo)


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, float32 1-D tensor). Header padded with spaces to 8 bytes."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * ((8 - len(blob) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in tensors:
            f.write(t.contiguous().numpy().astype("<f4", copy=False).tobytes())
    os.replace(tmp, path)


def run(name, elements, steps, seed, kernel=None):
    kind, kwargs, schedule, *rest = SETTINGS[name]
    kwargs = dict(kwargs)
    if kernel is not None:  # the torch kernel form: single-tensor, foreach or fused=True
        kwargs.pop("foreach", None)
        kwargs.update({"single": dict(foreach=False), "foreach": dict(foreach=True),
                       "fused": dict(fused=True)}[kernel])
    data = rest[0] if rest else "natural"
    gen = torch.Generator().manual_seed(seed)
    if data == "dead":
        w, scale, dead = dead_units(elements, gen)
    else:
        w = weight_like(elements, gen)
        scale, dead = gradient_scales(elements, gen)
    param = torch.nn.Parameter(w)
    base_lr = kwargs["lr"]
    if kind == "adamw":
        opt = torch.optim.AdamW([param], **kwargs)
    elif kind == "adam":
        opt = torch.optim.Adam([param], **kwargs)
    else:
        opt = torch.optim.SGD([param], **kwargs)
    bias_correction = True
    tensors = [("theta.0", param.detach().clone())]
    meta = {"optimizer": kind, "steps": steps, "bias_correction": str(bias_correction).lower(),
            "data": data, "torch": torch.__version__, "kernel": kernel or "default"}
    if kind == "adamw":
        # torch's CPU kernels (single-tensor, foreach, fused) multiply by 1 - lr*wd.
        meta["decay_form"] = "multiply"
    group = opt.param_groups[0]
    for s in range(1, steps + 1):
        lr = lr_at(schedule, base_lr, s, steps)
        group["lr"] = lr
        # Heavy tails plus a step-dependent global scale, as gradient norms drift in training.
        # (in double, so that gradients below FP32's range come out as subnormals, not zeros)
        g = (heavy_tailed(elements, gen).double() * scale.double() *
             (0.5 + torch.rand(1, generator=gen).item())).float()
        g[dead] = 0.0
        param.grad = g
        opt.step()
        st = opt.state[param]
        tensors.append((f"theta.{s}", param.detach().clone()))
        if kind == "sgd":
            tensors.append((f"momentum_buffer.{s}", st["momentum_buffer"].clone()))
        else:
            tensors.append((f"exp_avg.{s}", st["exp_avg"].clone()))
            tensors.append((f"exp_avg_sq.{s}", st["exp_avg_sq"].clone()))
            step_value = st["step"]
            meta[f"step.{s}"] = int(step_value.item() if torch.is_tensor(step_value) else step_value)
        meta[f"lr.{s}"] = repr(float(lr))
    meta["weight_decay"] = repr(float(group.get("weight_decay", 0.0)))
    if kind == "sgd":
        meta["momentum"] = repr(float(group["momentum"]))
        meta["dampening"] = repr(float(group["dampening"]))
        meta["nesterov"] = str(bool(group["nesterov"])).lower()
    else:
        meta["beta1"] = repr(float(group["betas"][0]))
        meta["beta2"] = repr(float(group["betas"][1]))
        meta["eps"] = repr(float(group["eps"]))
        meta["amsgrad"] = str(bool(group["amsgrad"])).lower()
    return tensors, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=sorted(SETTINGS), help="which optimizer setting to run")
    ap.add_argument("--list", action="store_true", help="print the setting names and exit")
    ap.add_argument("--out", help="output .safetensors path (all steps)")
    ap.add_argument("--audit-file", help="write one step (--audit-step) in the audit-inverse format")
    ap.add_argument("--audit-step", type=int, default=None, help="step for --audit-file (default: last)")
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--kernel", choices=["single", "foreach", "fused"],
                    help="force torch's kernel form (fused=True on the CPU needs torch >= 2.4); "
                         "default: the setting's own")
    args = ap.parse_args()
    if args.list:
        print("\n".join(sorted(SETTINGS)))
        return 0
    if not args.setting or not (args.out or args.audit_file):
        ap.error("--setting and one of --out / --audit-file are required")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tensors, meta = run(args.setting, args.elements, args.steps, args.seed, args.kernel)
    if args.out:
        write_safetensors(args.out, tensors, meta)
    if args.audit_file:
        s = args.audit_step or args.steps
        t = dict(tensors)
        one = [("theta_prev", t[f"theta.{s - 1}"]), ("theta", t[f"theta.{s}"])]
        if meta["optimizer"] == "sgd":
            one.append(("momentum_buffer", t[f"momentum_buffer.{s}"]))
        else:
            one += [("exp_avg", t[f"exp_avg.{s}"]), ("exp_avg_sq", t[f"exp_avg_sq.{s}"])]
        single = {k: v for k, v in meta.items() if "." not in k and k != "steps"}
        single["lr"] = meta[f"lr.{s}"]
        if f"step.{s}" in meta:
            single["step"] = meta[f"step.{s}"]
        write_safetensors(args.audit_file, one, single)
    return 0


if __name__ == "__main__":
    sys.exit(main())
