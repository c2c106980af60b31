# SPDX-License-Identifier: Apache-2.0
"""The reference for scenario.py: a stock vLLM engine (no weight-transfer backend) given each
version's checkpoint of the trainer's BF16 weights through vLLM's own loader, whose greedy
tokens and logprobs every dte-synced engine must equal exactly.

    python reference.py RECORD.json [RECORD.json ...]   one engine, reload_weights(checkpoint)
                                                          per version of every record
    python reference.py --fresh RECORD.json              a fresh engine on the last version's
                                                          checkpoint (LLM(model=checkpoint))

The records must share their tensor-parallel size (the engine's, as the numerics depend on it).
"""
import argparse
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("records", nargs="+")
    ap.add_argument("--fresh", action="store_true")
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
    if a.fresh:
        last = records[0]["versions"][-1]
        llm = LLM(model=last["checkpoint"], tensor_parallel_size=tp, **common.ENGINE)
        got = common.generate(llm)
        if got != last["generated"]:
            failures += 1
            print(f"FAIL: version {last['version']}: a fresh engine generates {got}, the synced "
                  f"one {last['generated']}", flush=True)
        print(f"fresh engine on version {last['version']}: {'equal' if not failures else 'DIFFERENT'}")
        sys.exit(1 if failures else 0)

    first = records[0]["versions"][0]["checkpoint"]
    llm = LLM(model=first, tensor_parallel_size=tp, **common.ENGINE)
    compared = 0
    for path, record in zip(a.records, records):
        for v in record["versions"]:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": v["checkpoint"]})
            llm.reset_prefix_cache()
            got = common.generate(llm)
            compared += 1
            if got != v["generated"]:
                failures += 1
                print(f"FAIL: {path} version {v['version']}: the reference generates {got}, the "
                      f"synced engine {v['generated']}", flush=True)
    print(f"{compared} versions compared, {failures} differ", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
