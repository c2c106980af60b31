# SPDX-License-Identifier: Apache-2.0
"""One vLLM engine kept in sync by dte through the "dte" weight-transfer backend, driven as a
user would (dte.vllm.init / update), while a real torch.optim.AdamW trains the same model.

After every publication it checks that every parameter of every worker equals the trainer's BF16
weights bit for bit, records greedy tokens and logprobs (the reference engine compares them,
reference.py), and saves the trainer's BF16 checkpoint for that version. With --refusals, each
kind of refused publication must raise with its reason and leave generation and parameters
exactly as they were.

    python scenario.py OUT [--family F] [--mode inproc|mp] [--every K] [--publications N]
                           [--tp T] [--storage] [--refusals] [--then-every K2]

--family: a model of common.FAMILIES (tied embeddings, Qwen2's biases, Llama). --then-every K2:
after the N publications the trainer restarts its publisher with publish_every=K2: without
continue_after= it is refused (the message says how to continue), then with continue_after=
dte.vllm.version(llm) N more publications follow, the first full.
"""
import argparse
import copy
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mode", choices=["inproc", "mp"], default="inproc")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--publications", type=int, default=20)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--storage", action="store_true")
    ap.add_argument("--refusals", action="store_true")
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--then-every", type=int, default=0)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if a.mode == "inproc" else "1"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    common.bind_cpu_workers(a.tp)
    import dte
    import dte.vllm
    from vllm import LLM

    os.makedirs(a.out, exist_ok=True)
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)
            print("FAIL:", what, flush=True)

    def same_generation(want, what):
        """The engine generates `want` still (exactly in-process; in mp mode within
        common.MP_LOGPROB_TOLERANCE, which says why)."""
        why = common.generation_differs(want, common.generate(llm), a.mode == "inproc")
        check(not why, f"{what}: {why}")

    trainer = common.make_trainer(family=a.family)
    opt = common.adamw(trainer)
    start = common.write_checkpoint(trainer, os.path.join(a.out, "start"))
    llm = LLM(model=start, tensor_parallel_size=a.tp, weight_transfer_config={"backend": "dte"},
              **common.ENGINE)
    # The backend came in through the vllm.general_plugins entry point: nothing imported here
    # reaches the engine core or its workers in mp mode.
    if a.refusals:
        # another model's config: the served parameters are not its layout; refused on init,
        # nothing touched (the engine then binds with its own)
        other = common.family_config(a.family, num_hidden_layers=1).to_dict()
        before_gen = common.generate(llm)
        try:
            dte.vllm.init(llm, config=other)
            check(False, "init with another model's config: accepted")
        except dte.InvalidArgument as e:
            check("differ in the structure" in str(e), f"init refusal: {e}")
        same_generation(before_gen, "a refused init changed generation")
        # the trainer's config with another norm eps: the same structure, another function
        drift = common.family_config(a.family, rms_norm_eps=1e-3).to_dict()
        try:
            dte.vllm.init(llm, config=drift)
            check(False, "init with another rms_norm_eps: accepted")
        except dte.InvalidArgument as e:
            check("rms_norm_eps" in str(e) and "0.001" in str(e), f"init drift refusal: {e}")
    dte.vllm.init(llm)
    check(dte.vllm.version(llm) is None, "a new engine holds a version")
    pub = dte.TorchPublisher(trainer, opt, publish_every=a.every, config=start)
    root = os.path.join(a.out, "root")
    writer = dte.StorageWriter(root, start) if a.storage else None

    def deliver(msg):
        if writer is not None:
            writer.write(msg)
            return dte.vllm.update(llm, storage=root)
        return dte.vllm.update(llm, publication=msg)

    record = {"tp": a.tp, "every": a.every, "family": a.family, "mode": a.mode, "versions": []}
    record_last_message = [None]
    step = 0
    deltas_since_full = [0]

    def publish(msg, at, full=False, why=None):
        """Delivers msg, the publication of the trainer state `at` (a copy of the trainer), and
        records why the reference compares this version (common.reference_reason), if it does."""
        t = time.perf_counter()
        reports = deliver(msg)
        record_last_message[0] = msg
        took = time.perf_counter() - t
        v = reports[0]["version"] if reports and reports[0] else None
        check(len(reports) == a.tp and all(r and r["version"] == v for r in reports),
              f"version {v}: reports {reports}")
        check(all(r["changed"] > 0 for r in reports), f"version {v}: a worker wrote nothing: {reports}")
        check(all(r["outcome"] == "committed" for r in reports), f"version {v}: outcomes {reports}")
        check(dte.vllm.version(llm) == v, f"version {v}: dte.vllm.version says {dte.vllm.version(llm)}")
        bad = common.parameter_mismatches(llm, at, a.tp)
        check(not bad, f"version {v}: parameters differ from the trainer's BF16 weights: {bad[:5]}")
        deltas_since_full[0] = 0 if full else deltas_since_full[0] + 1
        why = common.reference_reason(full, deltas_since_full[0], why)
        ckpt = common.write_checkpoint(at, os.path.join(a.out, f"v{v}"))
        record["versions"].append({"version": v, "checkpoint": ckpt, "generated": common.generate(llm),
                                   "bytes": len(msg), "update_seconds": took, "reference": why})
        print(f"version {v}: {len(msg)} bytes, update {took * 1e3:.1f} ms, workers "
              f"{[(r['changed'], round(r['apply_seconds'] * 1e3, 2), round(r['repack_seconds'] * 1e3, 2)) for r in reports]}"
              " (changed, apply ms, repack ms)", flush=True)

    def next_publication():
        nonlocal step
        while True:
            common.train_step(trainer, opt, step)
            step += 1
            msg = pub.step()
            if msg is not None:
                return msg, copy.deepcopy(trainer)

    def publish_deltas(until):
        """Deltas until the record holds `until` versions; the last one ends a run of deltas."""
        while len(record["versions"]) < until:
            last = len(record["versions"]) == until - 1
            publish(*next_publication(), why="the end of a run of deltas" if last else None)

    publish(pub.publish_full(), copy.deepcopy(trainer), full=True)
    publish_deltas(a.publications)
    if a.then_every:
        assert not a.storage, "--then-every delivers publications (a storage root has its own writer)"
        # The trainer restarts (same weights and optimizer state here): a publisher numbering
        # from 1 again is refused, saying how to continue; with continue_after it goes on.
        held = dte.vllm.version(llm)
        before_gen = common.generate(llm)
        fresh = dte.TorchPublisher(trainer, opt, publish_every=a.then_every, config=start)
        try:
            deliver(fresh.publish_full())
            check(False, "a restarted publisher's version 1: accepted")
        except dte.ProtocolError as e:
            check(f"continue_after={held}" in str(e) and "dte.vllm.version" in str(e),
                  f"restart refusal does not say how to continue: {e}")
        same_generation(before_gen, "a refused restart changed generation")
        pub = dte.TorchPublisher(trainer, opt, publish_every=a.then_every, config=start,
                                 continue_after=held)
        record["every"] = [a.every, a.then_every]
        publish(pub.publish_full(), copy.deepcopy(trainer), full=True)
        publish_deltas(2 * a.publications)
    if not a.storage:
        # a re-delivery of the version held: every worker says 'current', nothing moves
        again = dte.vllm.update(llm, publication=record_last_message[0])
        check(all(r["outcome"] == "current" for r in again), f"re-delivery outcomes: {again}")

    if a.refusals:
        refusals = []

        def refused(kind, msg, cls, reason):
            """msg must be refused with a `cls` saying `reason`, leaving the engine as it was."""
            before_gen = common.generate(llm)
            before = llm.collective_rpc("compute_weight_checksums")
            try:
                dte.vllm.update(llm, publication=msg)
                check(False, f"{kind}: accepted")
            except dte.Error as e:  # the worker's own class, in either mode (dte.vllm.update)
                check(isinstance(e, cls) and reason in str(e),
                      f"{kind}: not a {cls.__name__} saying {reason!r}: {type(e).__name__}: {e}")
                refusals.append([kind, type(e).__name__, str(e).strip().splitlines()[-1][:300]])
            check(llm.collective_rpc("compute_weight_checksums") == before, f"{kind}: parameters changed")
            same_generation(before_gen, f"{kind}: generation changed")

        m1, at1 = next_publication()  # the version held + 1
        m2, at2 = next_publication()  # + 2, its base + 1
        corrupt = bytearray(m1)
        corrupt[len(corrupt) // 2] ^= 0x40
        refused("corrupt", bytes(corrupt), dte.FormatError, "checksum")
        refused("wrong base", m2, dte.ProtocolError, "a delta on base version")
        other = common.make_trainer(seed=3, family=a.family, num_hidden_layers=1)
        other_pub = dte.TorchPublisher(other, common.adamw(other), config=other.config.to_dict())
        refused("another model", other_pub.publish_full(), dte.ProtocolError, "the manifest is for model")
        # the same structure trained with another rope_theta: refused by name, nothing written
        drifted = common.make_trainer(seed=3, family=a.family, rope_theta=12345.0)
        drift_pub = dte.TorchPublisher(drifted, common.adamw(drifted), config=drifted.config.to_dict())
        refused("config drift", drift_pub.publish_full(), dte.ProtocolError, "rope_theta (the trainer's config: 12345.0")
        # vLLM's own calls, as a user or the HTTP routes make them, with a malformed info: refused
        # like a publication (the engine stays usable: m1 and m2 follow)
        before_gen = common.generate(llm)
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"publication": m1, "storage": "/nowhere"}})
            check(False, "malformed info: accepted")
        except Exception as e:
            check("exactly one of" in str(e), f"malformed info: {e}")
            refusals.append(["malformed info", type(e).__name__, str(e).strip().splitlines()[-1][:200]])
        try:
            llm.finish_weight_update()  # ends the other workers' sessions (dte.vllm.update's way)
        except Exception:
            pass
        same_generation(before_gen, "malformed info: generation changed")
        publish(m1, at1, why="the first delta after refused publications")
        publish(m2, at2, why="a delta after refused publications")
        refused("older version", m1, dte.ProtocolError, "is older than the version")
        # a full publication resynchronises whatever the engine holds; deltas follow on it
        publish(pub.publish_full(), copy.deepcopy(trainer), full=True)
        publish(*next_publication())
        record["refusals"] = refusals
        for r in refusals:
            print("refused:", r, flush=True)

    common.save_json(os.path.join(a.out, "record.json"), record)
    if failures:
        print(f"{len(failures)} failures", flush=True)
        sys.exit(1)
    print("scenario passed", flush=True)


if __name__ == "__main__":
    main()
