# SPDX-License-Identifier: Apache-2.0
"""The Python examples run to their end and say so (each checks bit-identity itself)."""
import os
import shutil
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")


def run(cmd, timeout=300):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_rl_loop(tmp_path):
    out = run([sys.executable, os.path.join(EXAMPLES, "rl_loop.py"), "--steps", "8", "--dir", str(tmp_path)])
    assert "both workers bit-identical" in out
    assert (tmp_path / "LATEST").read_text().strip() == "v%020d" % 9  # v1 full, then 8 deltas


def test_mpi_receivers():
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: install openmpi-bin (tools/install-deps.sh)"
    flags = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    out = run([mpirun, *flags, "-np", "3", sys.executable, os.path.join(EXAMPLES, "mpi_receivers.py"),
               "--steps", "6"])
    assert "digests match" in out
    assert out.count("bit-identical") == 2
