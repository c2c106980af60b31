# SPDX-License-Identifier: Apache-2.0
"""Sharded PyTorch trainers publish through dte (issue 29), on 2 and 3 processes over gloo:
FSDP2 (per layer plus root; default, foreach and fused AdamW, Adam, SGD; bf16 mixed precision;
K = 1 and K = 4; a refusal on one rank; its own group object with dst on the last rank), HSDP,
FSDP1 (use_orig_params=True), DDP + ZeroRedundancyOptimizer, DTensor tensor parallelism
on the MLP. The model has a vocabulary no world size divides, norms with fewer elements than
ranks, and a frozen parameter. This process holds the receivers: an HF receiver, compared bit
for bit after every publication with the full parameters the trainer gathered by torch's own
means, and the two ranks of a tp=2 SGLang layout, checked against the trainer's digest; and a
storage root written with every publication, followed by a reader (compared bit for bit too).
Then a trainer rank killed mid-publication: the receivers keep the previous version, and a
restarted job resynchronises them with a full publication (continue_after).

Needs torch >= 2.6 (fully_shard): run in the PyPI-torch venv (tools/python-tests.sh)."""
import io
import multiprocessing
import queue as queue_mod
import socket
import tempfile

import pytest
import torch

pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("torch.distributed.fsdp.fully_shard needs torch >= 2.6", allow_module_level=True)

import dte  # noqa: E402
import trainers  # noqa: E402
from trainers import CONFIG, FROZEN, SKIPPED  # noqa: E402

STEPS = 21  # K = 1: a full publication and 21 deltas; K = 4: a full one and 21 deltas over 84 steps
SCENARIOS = [
    ("fsdp2", "fsdp2", "default", 1, STEPS),
    ("fsdp2-foreach", "fsdp2", "foreach", 1, STEPS),
    ("fsdp2-fused", "fsdp2", "fused", 1, STEPS),
    ("fsdp2-bf16", "fsdp2", "bf16", 1, STEPS),
    ("fsdp2-k4", "fsdp2", "default", 4, 4 * STEPS),
    ("fsdp2-adam", "fsdp2", "adam", 1, STEPS),
    ("fsdp2-sgd", "fsdp2", "sgd", 1, STEPS),
    ("fsdp2-refuse", "fsdp2", "refuse", 1, STEPS + 1),  # step 7 refused on the last rank
    ("fsdp2-group", "fsdp2", "group", 1, STEPS),  # its own group object, dst = the last rank
    ("hsdp", "hsdp", "default", 1, STEPS),
    ("fsdp1", "fsdp1", "default", 1, STEPS),
    ("zero", "zero", "default", 1, STEPS),
    ("tp", "tp", "default", 1, STEPS),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bits(t):
    return t.contiguous().view(torch.int16)


class Receivers:
    """An HF receiver and a tp=2 replica, in this process; and a storage root written with every
    publication, which a third (HF) receiver follows."""

    def __init__(self):
        self.hf_tensors = None
        self.hf = None
        self.root = tempfile.mkdtemp(prefix="dte-sharded-")
        self.writer = dte.StorageWriter(self.root, CONFIG)
        self.stored = {}
        self.reader = None
        self.shards = []
        for r in range(2):
            t = {n: torch.zeros(s, dtype=torch.bfloat16)
                 for n, s in dte.TorchReceiver.shard_tensors(CONFIG, "tp=2", r).items()}
            self.shards.append((t, dte.TorchReceiver(t, config=CONFIG, infer="tp=2", rank=r)))

    def apply(self, msg, expected, digest):
        expected = torch.load(io.BytesIO(expected))
        if self.hf is None:
            self.hf_tensors = {n: torch.full(t.shape, float("nan"), dtype=torch.bfloat16)
                               for n, t in expected.items()}
            self.hf = dte.TorchReceiver(self.hf_tensors, config=CONFIG)
            self.stored = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in expected.items()}
            self.reader = dte.StorageReader(self.root, dte.TorchReceiver(self.stored, config=CONFIG))
        report = self.hf.apply(msg)
        self.writer.write(msg)
        assert self.reader.poll()["to"] == report["version"]
        for _, rx in self.shards:
            rx.apply(msg)
        bad = sum(int((bits(self.hf_tensors[n]) != bits(expected[n])).sum()) for n in expected)
        assert bad == 0, f"{bad} elements differ from the trainer's gathered parameters"
        bad = sum(int((bits(self.stored[n]) != bits(expected[n])).sum()) for n in expected)
        assert bad == 0, f"{bad} elements differ through storage"
        assert self.hf.digest() == tuple(digest)
        assert dte.replica_matches([rx for _, rx in self.shards], digest)
        assert self.hf.verify()
        return report


def launch(world, scenarios, q, **kw):
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=trainers.run, args=(r, world, port, scenarios, q), kwargs=kw)
             for r in range(world)]
    for p in procs:
        p.start()
    return procs


def drain(q, procs, scenarios, receivers=None):
    """Applies every publication rank 0 sends, each scenario to its own receivers (or all to
    `receivers`); returns the reports per scenario, and the receivers."""
    seen = {name: [] for name, *_ in scenarios}
    held = {name: receivers or Receivers() for name, *_ in scenarios}
    refused = {}
    done = set()
    while len(done) < len(scenarios):
        try:
            item = q.get(timeout=300)
        except queue_mod.Empty:
            raise AssertionError(f"no word from the trainer for 300 s (done: {sorted(done)})")
        if item[0] == "error":
            raise AssertionError(f"trainer rank {item[1]} failed: {item[2]}")
        if item[0] == "done":
            done.add(item[1])
            continue
        if item[0] == "refused":
            refused.setdefault(item[1], []).append(item[2])
            continue
        _, name, msg, expected, digest, report = item
        try:
            applied = held[name].apply(msg, expected, digest)
        except Exception as e:
            raise AssertionError(f"scenario {name}, publication {len(seen[name]) + 1}: {e}") from e
        seen[name].append((applied, report))
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    return seen, held, refused


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_trainers_publish_bit_identical(world):
    q = multiprocessing.get_context("spawn").Queue()
    procs = launch(world, SCENARIOS, q)
    try:
        seen, held, refused = drain(q, procs, SCENARIOS)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for name, _, _, every, _ in SCENARIOS:
        receivers_total = sum(t.numel() for t in held[name].hf_tensors.values())
        pubs = seen[name]
        assert len(pubs) >= 22, name  # a full publication and 21 deltas
        fulls = [k for k, (a, _) in enumerate(pubs) if a["full"]]
        if name == "fsdp2-refuse":
            # every rank raised (the dst rank: the last rank's own refusal, relayed); the
            # publication after the refused step is full on every rank
            assert len(refused[name]) == 1 and "trainer rank" in refused[name][0], refused
            assert "exp_avg_sq" in refused[name][0], refused
            assert fulls == [0, 8], fulls
        else:
            assert fulls == [0], (name, fulls)
        assert all(a["changed"] > 0 for a, _ in pubs[1:]), name
        # the frozen parameter is never written again
        assert not any(FROZEN in a["touched"] for a, _ in pubs if not a["full"]), name
        # a parameter without a gradient in a step (every third) is unchanged by it
        if every == 1 and name != "fsdp2-refuse":
            skipped = [pubs[k][0] for k in range(1, len(pubs)) if (k - 1) % 3 == 1]
            assert skipped and not any(SKIPPED in a["touched"] for a in skipped), name
            assert any(SKIPPED in a["touched"] for a, _ in pubs[1:]), name
        # the receiving rank scans only the elements it sends, not the model (HSDP: replicate
        # coordinate 0 sends every element, the other replicas none)
        scanned = pubs[-1][1]["scanned"]
        if name == "hsdp":
            assert scanned == receivers_total, (name, scanned, receivers_total)
        else:
            assert 0 < scanned < receivers_total, (name, scanned, receivers_total)
        assert pubs[-1][1]["message_changed"] == pubs[-1][0]["changed"], name


def test_a_rank_killed_mid_publication_then_a_restarted_job_resynchronises():
    world = 2
    scenarios = [("fsdp2", "fsdp2", "default", 1, 12)]
    receivers = Receivers()
    q = multiprocessing.get_context("spawn").Queue()
    procs = launch(world, scenarios, q, die=6)
    # publications v1 (full) .. v7 (after step 5); rank 1 dies in step 6's publication
    versions = []
    try:
        while True:
            item = q.get(timeout=300)
            if item[0] == "pub":
                receivers.apply(item[2], item[3], item[4])
                versions.append(receivers.hf.version)
            elif item[0] == "error":
                assert item[1] == 0, item  # the survivor learns the publication failed
                break
            else:
                raise AssertionError(f"the job ended without the failure: {item}")
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert versions == list(range(1, 8))
    assert procs[1].exitcode == 3
    # nothing of the failed version reached the receivers: they hold v7, every tensor as the
    # trainer gathered it then (checked when v7 was applied) and unchanged since
    assert receivers.hf.version == 7
    assert receivers.hf.verify()
    assert dte.replica_matches([rx for _, rx in receivers.shards], receivers.hf.digest())
    # the restarted job (fresh weights: as if resumed from an older checkpoint) continues the
    # numbering; its first publication is full and resynchronises every receiver
    q = multiprocessing.get_context("spawn").Queue()
    procs = launch(world, [("fsdp2", "fsdp2", "default", 1, 3)], q, continue_after=7)
    seen, _, _ = drain(q, procs, [("fsdp2",)], receivers)
    applied = [a for a, _ in seen["fsdp2"]]
    assert applied[0]["full"] and [a["version"] for a in applied] == [8, 9, 10, 11]
