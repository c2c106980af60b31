# SPDX-License-Identifier: Apache-2.0
"""The reference for scenario.py and server.py: for every version a record holds, a fresh stock
vLLM engine (no weight-transfer backend) made from that version's checkpoint of the trainer's
BF16 weights (LLM(model=checkpoint)), whose greedy tokens and logprobs the dte-synced engine must
equal exactly.

    python reference.py RECORD.json [RECORD.json ...]

Fresh engines, not one engine given each checkpoint by reload_weights: on vLLM 0.32's CPU
platform reload_weights leaves a tied lm_head computing from the embedding packed at start
(seen: such a reference differs from a fresh engine from the second version on), the very
failure these tests exist to catch. The engines run one after the other in this process
(about a second each at tp = 1). The records must share their tensor-parallel size.

A record of an in-process engine must be equal exactly: there, a fresh stock engine gives the
same tokens and logprobs as another on the same checkpoint. Multi-process engines (mode "mp":
tp = 2, servers) on this project's AMX machines do not: two stock multi-process engines on one
checkpoint, or a stock one and an in-process one, differ by up to ~3e-5 in a logprob after a
few decode steps (measured; the numerics depend on the process). Their records must give the
same tokens and every logprob within MP_LOGPROB_TOLERANCE (a token only one side lists in its
top 2: a near tie with the other side's last), which a stale layer exceeds by
orders of magnitude (a stale tied lm_head changes the tokens of most prompts).
"""
import argparse
import gc
import os
import sys

MP_LOGPROB_TOLERANCE = 1e-3


def differs(got, synced, exact):
    """Why the synced engine's generation differs from the reference's ('' if it does not)."""
    if exact:
        return "" if got == synced else "not equal exactly"
    worst = 0.0
    for g, s in zip(got, synced):
        if g["tokens"] != s["tokens"]:
            return f"tokens {s['tokens']} where the reference has {g['tokens']}"
        for a, b in zip(g["logprobs"], s["logprobs"]):
            a, b = dict(map(tuple, a)), dict(map(tuple, b))
            for t in set(a) | set(b):
                if t in a and t in b:
                    worst = max(worst, abs(a[t] - b[t]))
                else:  # a near tie for the last place of the top 2 may swap it
                    x, other = (a[t], b) if t in a else (b[t], a)
                    worst = max(worst, abs(x - min(other.values())))
    if len(got) != len(synced) or worst > MP_LOGPROB_TOLERANCE:
        return f"a logprob {worst:.3g} away"
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("records", nargs="+")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    records = [common.load_json(p) for p in a.records]
    tp = {r["tp"] for r in records}
    assert len(tp) == 1, f"records of several tp sizes {tp}: one reference run per size"
    tp = tp.pop()
    common.bind_cpu_workers(tp)
    from vllm import LLM

    failures = 0
    compared = 0
    exact = 0
    for path, record in zip(a.records, records):
        for v in record["versions"]:
            llm = LLM(model=v["checkpoint"], tensor_parallel_size=tp, **common.ENGINE)
            got = common.generate(llm)
            del llm
            gc.collect()
            compared += 1
            exact += got == v["generated"]
            why = differs(got, v["generated"], record.get("mode", "inproc") == "inproc")
            if why:
                failures += 1
                print(f"FAIL: {path} version {v['version']}: {why}: a fresh stock engine "
                      f"generates {got}, the synced engine {v['generated']}", flush=True)
    print(f"{compared} versions compared, {failures} differ ({exact} equal exactly)", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
