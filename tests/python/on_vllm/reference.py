# SPDX-License-Identifier: Apache-2.0
"""The reference for scenario.py and server.py: for every version a record names a reason for
(its "reference" field, common.reference_reason: full publications, the deltas after them, the end
of each run of deltas, the deltas after refusals; a record without the field: every version), a
fresh stock vLLM engine (no weight-transfer backend) made from that version's checkpoint of the
trainer's BF16 weights (LLM(model=checkpoint)), whose greedy tokens and logprobs the dte-synced
engine must equal exactly. The last version of each record is always compared
(common.reference_versions).

    python reference.py RECORD.json [RECORD.json ...]

Fresh engines, not one engine given each checkpoint by reload_weights: on vLLM 0.32's CPU
platform reload_weights leaves a tied lm_head computing from the embedding packed at start
(seen: such a reference differs from a fresh engine from the second version on), the very
failure these tests exist to catch. The engines run one after the other in this process
(about 1 s each at tp = 1, 14 s at tp = 2). The records must share their tensor-parallel size.

A record of an in-process engine must be equal exactly: there, a fresh stock engine gives the
same tokens and logprobs as another on the same checkpoint. Multi-process engines (mode "mp":
servers) are not reproducible to the bit (measured: common.MP_LOGPROB_TOLERANCE says how):
their records must give the same tokens and every logprob within that tolerance.
"""
import argparse
import gc
import os
import sys


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
        exact_rule = record.get("mode", "inproc") == "inproc"
        for v in common.reference_versions(record):
            llm = LLM(model=v["checkpoint"], tensor_parallel_size=tp, **common.ENGINE)
            got = common.generate(llm)
            del llm
            gc.collect()
            compared += 1
            exact += got == v["generated"]
            why = common.generation_differs(got, v["generated"], exact_rule)
            if why:
                failures += 1
                print(f"FAIL: {path} version {v['version']}: {why}: a fresh stock engine "
                      f"generates {got}, the synced engine {v['generated']}", flush=True)
    print(f"{compared} versions compared, {failures} differ ({exact} equal exactly)", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
