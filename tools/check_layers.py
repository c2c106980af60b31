#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The layer check (docs/engine.md, "Layers"): a header of include/dte may include headers of its
own layer and of the layers below it, never one above. LAYERS is the order, lowest first, written
down here once; each entry is a folder (ending in /) or a single file, relative to include/dte.
The longest matching entry decides a header's layer. dte/sim/ is not in include/dte: it is the
testing target dte_testing (testing/include), which no installed header may include.

KNOWN lists the upward includes that exist today and are to be removed (each one names its way
out). The check fails on any upward include not listed, and on a listed one that no longer exists
(delete it from KNOWN: the list only shrinks).

  tools/check_layers.py [ROOT]     exit 0: clean; 1: a violation (printed)
"""
import os
import re
import sys

LAYERS = [
    # 0. what every header may use
    ("base", ["config.hpp", "error.hpp", "bounds.hpp", "numeric/"]),
    # 1. the vocabulary every side speaks: versions, message kinds, the digest, payload bytes
    ("vocabulary", ["core/", "reconstruction.hpp", "storage/value_code.hpp"]),
    # 2. the policies and the model: layouts, optimizer inverses, detectors, their concepts
    ("policies", ["concepts.hpp", "layout/", "optim/", "detect/", "audit.hpp"]),
    # 3. executors: threads, SIMD, CUDA streams and memory
    ("exec", ["exec/"]),
    # 4. the pipeline's stages over an executor
    ("pipeline", ["pipeline/"]),
    # 5. files and formats
    ("io", ["io/"]),
    # 6. the receiver core and its routing
    ("receive", ["receive/"]),
    # 7. transports between ranks
    ("transport", ["transport/"]),
    # 8. the engine: sender frame, receivers, schedule
    ("engine", ["engine/"]),
    # 9. storage, then self-contained publications over it
    ("storage", ["storage/"]),
    ("publication", ["publication/"]),
    # 10. the umbrella header
    ("umbrella", ["dte.hpp"]),
]

# (header, included header): upward includes still to remove, each with its way out. None is
# left; an entry may only be removed.
KNOWN = set()

INCLUDE = re.compile(r'^\s*#\s*include\s+"dte/([^"]+)"')


def layer_of(path):
    best, rank = None, None
    for k, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if (path == e or (e.endswith("/") and path.startswith(e))) and (
                    best is None or len(e) > len(best)):
                best, rank = e, k
    return rank


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    base = os.path.join(root, "include", "dte")
    bad, seen, headers = [], set(), 0
    for dirpath, _, names in os.walk(base):
        for n in sorted(names):
            if not n.endswith((".hpp", ".cuh", ".inc")):
                continue
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, base).replace(os.sep, "/")
            headers += 1
            mine = layer_of(rel)
            if mine is None:
                bad.append(f"{rel}: in no layer; add its folder to LAYERS in tools/check_layers.py")
                continue
            with open(full, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    dep = m.group(1)
                    theirs = layer_of(dep)
                    if dep.startswith("sim/"):
                        bad.append(f"{rel}:{line_no}: includes dte/{dep}, a testing header "
                                   f"(testing/include, dte_testing) that is not installed")
                    elif theirs is None:
                        bad.append(f"{rel}:{line_no}: includes dte/{dep}, which is in no layer")
                    elif theirs > mine:
                        if (rel, dep) in KNOWN:
                            seen.add((rel, dep))
                        else:
                            bad.append(f"{rel}:{line_no}: layer '{LAYERS[mine][0]}' includes "
                                       f"dte/{dep} of layer '{LAYERS[theirs][0]}', above it")
    for gone in sorted(KNOWN - seen):
        bad.append(f"{gone[0]} no longer includes {gone[1]}: remove it from KNOWN")
    for b in bad:
        print(b)
    print(f"check_layers: {headers} headers, {len(LAYERS)} layers, {len(seen)} known upward "
          f"includes left, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
