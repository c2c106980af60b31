# SPDX-License-Identifier: Apache-2.0
"""examples/python/vllm_rl_loop.py and fsdp_rl_loop.py run (in the vLLM venv:
tools/python-tests.sh): vLLM rollouts, policy-gradient steps, a dte publication every 2 steps
applied through the "dte" backend into a multi-process engine, and at the end every worker holds
the trainer's weights (digests)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "python", "vllm_rl_loop.py")


def test_vllm_rl_loop(tmp_path):
    p = subprocess.run([sys.executable, EXAMPLE, "--steps", "12", "--every", "2", "--mp",
                        "--dir", str(tmp_path / "policy")], capture_output=True, text=True, timeout=600)
    out = p.stdout
    assert p.returncode == 0, (out + p.stderr)[-4000:]
    assert "the engine holds the trainer's weights: yes" in out, out
    published = [l for l in out.splitlines() if l.startswith("step") and "version" in l]
    assert len(published) == 6, out  # steps 2, 4, ..., 12


FSDP = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "python", "fsdp_rl_loop.py")


def test_fsdp_rl_loop(tmp_path):
    """examples/python/fsdp_rl_loop.py: a trainer sharded with FSDP2 over 2 gloo processes, each
    publishing its shard's changes, merged on rank 0 and applied to a vLLM engine through the
    "dte" backend; at the end the engine's workers hold the trainer's weights (digests)."""
    pytest.importorskip("torch.distributed.fsdp")
    p = subprocess.run([sys.executable, FSDP, "--steps", "8", "--every", "2",
                        "--dir", str(tmp_path / "policy")], capture_output=True, text=True, timeout=600)
    out = p.stdout
    assert p.returncode == 0, (out + p.stderr)[-4000:]
    assert "the engine holds the trainer's weights: yes" in out, out
    published = [l for l in out.splitlines() if l.startswith("step") and "version" in l]
    assert len(published) == 4, out  # steps 2, 4, 6, 8
