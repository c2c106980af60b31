#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Storage interop (issue 12): what dte writes opens with standard tools.

  * a delta chunk, decompressed by the `zstd` command, opens with Python's `safetensors`; its
    metadata says what it is, and its values, decoded from the documented format alone, are the
    trainer's BF16 weights at the indices it lists;
  * an anchor directory opens with `safetensors` and its `model.safetensors.index.json` lists
    every tensor; the tensors equal the trainer's BF16 weights.

usage: interop.py DTE WORKDIR
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
from safetensors import safe_open


def bf16_bits(f32):
    """Round-to-nearest-even of float32 to BF16 bits (no NaN in these weights)."""
    u = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def trainer_weights(dump):
    """The trainer's F32 weights, by HF name (safetensors, numpy)."""
    with safe_open(os.path.join(dump, "trainer.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def raw_tensors(path):
    """name -> (dtype, shape, little-endian bytes), with safetensors' own parser."""
    from safetensors import deserialize
    with open(path, "rb") as f:
        return {name: (t["dtype"], list(t["shape"]), bytes(t["data"])) for name, t in deserialize(f.read())}


def gaps(stream, count):
    """The documented index code: a gap below 255 in one byte, else 255 and a u16, and from
    65535 on that u16 = 65535 and a u32 (little-endian)."""
    stream = bytes(stream)  # plain ints
    out, nxt, at = [], 0, 0
    for _ in range(count):
        g = stream[at]
        at += 1
        if g == 255:
            g = int.from_bytes(stream[at:at + 2], "little")
            at += 2
            if g == 65535:
                g = int.from_bytes(stream[at:at + 4], "little")
                at += 4
        out.append(nxt + g)
        nxt = out[-1] + 1
    assert at == len(stream), "trailing index bytes"
    return out


def run(dte, *args):
    subprocess.run([dte, *args], check=True, stdout=subprocess.DEVNULL)


def main():
    dte, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    common = ["--model", "tiny-qwen3", "--train", "tp=2", "--infer", "tp=1", "--lr", "1e-4"]

    # A delta: the last version of 3 steps with no anchor after the first.
    root, dump = os.path.join(work, "delta"), os.path.join(work, "delta-dump")
    run(dte, "simulate", "--transport", "storage", "--dir", root, "--steps", "3", "--dump", dump,
        *common)
    w = trainer_weights(dump)
    latest = open(os.path.join(root, "LATEST")).read().strip()
    vdir = os.path.join(root, latest)
    manifest = json.load(open(os.path.join(vdir, "manifest.json")))
    assert manifest["base"] is not None, "the last version should be a delta"
    checked = 0
    for entry in manifest["chunks"]:
        plain = os.path.join(work, entry["file"] + ".safetensors")
        subprocess.run(["zstd", "-q", "-d", os.path.join(vdir, entry["file"]), "-o", plain],
                       check=True)
        with safe_open(plain, framework="numpy") as f:
            meta = f.metadata()
            assert meta["dte.format"] == "chunk-v1", meta
            assert int(meta["dte.version"]) == manifest["version"], meta
            assert int(meta["dte.base"]) == manifest["base"], meta
            assert meta["dte.encoding"] == "value", meta
            names = sorted({k.rsplit(":", 1)[0] for k in f.keys()})
            for name in names:
                index_stream = f.get_tensor(name + ":index")
                hi = f.get_tensor(name + ":value_hi")
                lo = f.get_tensor(name + ":value_lo")
                assert index_stream.dtype == np.uint8 and hi.shape == lo.shape
                n = hi.shape[0]
                index = gaps(index_stream, n)
                values = (hi.astype(np.uint16) << 8) | lo.astype(np.uint16)
                want = bf16_bits(w[name].reshape(-1))[index]
                assert np.array_equal(values, want), name
                checked += n
    assert checked == manifest["changed"], (checked, manifest["changed"])
    print(f"delta {latest}: {len(manifest['chunks'])} chunks, {checked} values equal the trainer's")

    # An anchor: the last of 3 steps is version 4 with --anchor-every 4.
    root, dump = os.path.join(work, "anchor"), os.path.join(work, "anchor-dump")
    run(dte, "simulate", "--transport", "storage", "--dir", root, "--steps", "3",
        "--anchor-every", "4", "--dump", dump, *common)
    w = trainer_weights(dump)
    vdir = os.path.join(root, open(os.path.join(root, "LATEST")).read().strip())
    index = json.load(open(os.path.join(vdir, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(w), "the index must list every tensor"
    seen = set()
    for shard in sorted(set(index["weight_map"].values())):
        for name, (dtype, shape, data) in raw_tensors(os.path.join(vdir, shard)).items():
            assert dtype in ("BF16", "bfloat16"), (name, dtype)
            assert shape == list(w[name].shape), (name, shape)
            bits = np.frombuffer(data, dtype="<u2")
            assert np.array_equal(bits, bf16_bits(w[name].reshape(-1))), name
            seen.add(name)
    assert seen == set(w)
    print(f"anchor: {len(seen)} tensors in {len(set(index['weight_map'].values()))} files equal "
          f"the trainer's BF16 weights")


if __name__ == "__main__":
    main()
