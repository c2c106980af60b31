# SPDX-License-Identifier: Apache-2.0
"""dte.sglang.load on SGLang 0.5.23's own model classes, per TP rank on the CPU.

Per scenario, two copies of each TP rank's model: one filled after every publication by
SGLang's own load_weights with the trainer's BF16 weights (the reference), the other kept in
sync only through dte.sglang.load, called by SGLang's own WeightUpdater.update_weights_from_tensor
with the payload serialized the way the Engine (MultiprocessingSerializer) or the HTTP route
(plain pickle, base64) sends it. After every publication every parameter of every rank must be
equal, bit for bit; a refused publication must leave every rank as it was."""
import base64
import http.server
import json
import pickle
import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

import dte  # noqa: E402
import dte.sglang  # noqa: E402
import sglang_ranks as sr  # noqa: E402

PUBLICATIONS = 22


def _serialized(items, http: bool, tp: int = 1):
    """What a worker gets, as SGLang's scheduler deserializes it: the Engine's list (dte.sglang
    .for_engine, serialized with SGLang's MultiprocessingSerializer, as
    Engine._serialize_tensors_per_rank does), or the HTTP route's base64 text of a plain pickle
    (dte.sglang.update_server)."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    if http:
        return MultiprocessingSerializer.deserialize(base64.b64encode(pickle.dumps(items)).decode())
    return MultiprocessingSerializer.deserialize(
        MultiprocessingSerializer.serialize(dte.sglang.for_engine(items, tp)))


class Replica:
    """One SGLang engine's TP ranks: the copy dte keeps and the reference, per rank."""

    def __init__(self, family, tp, ep):
        self.family, self.tp, self.ep = family, tp, ep
        self.synced = [sr.build(family, tp, ep, r) for r in range(tp)]
        self.reference = [sr.build(family, tp, ep, r) for r in range(tp)]
        # As a server starts: loaded by SGLang from a checkpoint (here another model's weights,
        # so that the first, full publication must overwrite every element dte owns; the
        # vocabulary's padding rows are SGLang's, zeroed by its loader, never dte's).
        other = sr.Trainer(family, seed=99).bf16_weights()
        for r, m in enumerate(self.synced):
            with sr.as_rank(tp, ep, r):
                m.load_weights(iter(other))
        self.updaters = [sr.weight_updater(m, r, [dte.sglang.LOADER]) for r, m in enumerate(self.synced)]

    def deliver(self, message: bytes, http: bool = False) -> list:
        items = dte.sglang.payload(publication=message)
        reports = []
        for r in range(self.tp):
            with sr.as_rank(self.tp, self.ep, r):
                ok, text = self.updaters[r].update_weights_from_tensor(
                    _serialized(items, http, self.tp), load_format=dte.sglang.LOADER)
                assert ok, text
            reports.append(dte.sglang.report(self.synced[r]))
        return reports

    def load_reference(self, weights) -> None:
        for r, m in enumerate(self.reference):
            with sr.as_rank(self.tp, self.ep, r):
                m.load_weights(iter(weights))

    def mismatches(self) -> list:
        bad = []
        for r, (a, b) in enumerate(zip(self.synced, self.reference)):
            pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
            assert sorted(pa) == sorted(pb)
            bad += [f"rank {r} {n}" for n in pa if not torch.equal(pa[n].view(torch.int16), pb[n].view(torch.int16))]
        return bad

    def snapshot(self) -> list:
        return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in self.synced]

    def unchanged_since(self, snap) -> bool:
        return all(torch.equal(p.view(torch.int16), snap[r][n].view(torch.int16))
                   for r, m in enumerate(self.synced) for n, p in m.named_parameters())


SCENARIOS = [
    ("qwen3", 1, 1),
    ("qwen3", 2, 1),
    ("qwen3", 4, 1),  # 2 KV heads over 4 ranks: each replicated
    ("qwen3-moe", 1, 1),
    ("qwen3-moe", 2, 1),  # every expert split by MoE TP
    ("qwen3-moe", 4, 1),  # ... and KV heads replicated
    ("qwen3-moe", 2, 2),  # experts split by EP, each whole (moe_tp 1)
    ("qwen3-moe", 4, 2),  # EP 2 x MoE TP 2
    ("qwen2", 2, 1),  # q/k/v biases
    ("qwen3-tied", 2, 1),  # one embedding parameter, no lm_head
]


@pytest.mark.parametrize("family,tp,ep", SCENARIOS, ids=[f"{f}-tp{t}-ep{e}" for f, t, e in SCENARIOS])
def test_in_sync_after_every_publication(family, tp, ep):
    trainer = sr.Trainer(family)
    pub = dte.TorchPublisher(trainer.published, trainer.optimizer, config=sr.config_dict(family))
    replica = Replica(family, tp, ep)

    reports = replica.deliver(pub.publish_full())
    assert [r["refused"] for r in reports] == [None] * tp
    assert all(r["full"] and r["version"] == pub.version for r in reports)
    replica.load_reference(trainer.bf16_weights())
    assert replica.mismatches() == []

    held = None
    for step in range(PUBLICATIONS):
        trainer.step(step)
        message = pub.step()
        assert message is not None
        if step == 5:
            # A corrupt copy, then a publication that skips one: every rank refuses, nothing moves.
            snap = replica.snapshot()
            bad = bytearray(message)
            bad[len(bad) // 2] ^= 0x40
            for r in replica.deliver(bytes(bad)):
                assert r["refused"] is not None and r["refused"].startswith("dte."), r
            assert replica.unchanged_since(snap)
            held = message
            continue
        if step == 6:
            snap = replica.snapshot()
            for r in replica.deliver(message):  # on a base the workers do not hold yet
                assert r["refused"] is not None and "dte.ProtocolError" in r["refused"], r
            assert replica.unchanged_since(snap)
            assert [r["refused"] for r in replica.deliver(held)] == [None] * tp
        reports = replica.deliver(message, http=step % 2 == 1)
        assert [r["refused"] for r in reports] == [None] * tp, reports
        assert all(r["version"] == pub.version and r["applied"] == [pub.version] for r in reports)
        assert sum(r["changed"] for r in reports) > 0  # every step moved served weights
        replica.load_reference(trainer.bf16_weights())
        assert replica.mismatches() == [], f"after publication {pub.version}"


def test_refuses_a_model_that_is_not_the_config_s():
    """A worker whose parameters are not dte's layout for its rank refuses at its first load and
    writes nothing; the refusal is in its report, not raised into SGLang."""
    trainer = sr.Trainer("qwen3")
    pub = dte.TorchPublisher(trainer.published, trainer.optimizer, config=sr.config_dict("qwen3"))
    model = sr.build("qwen3", 2, 1, 0)
    model.config.intermediate_size = 96  # the served model's config says another shape
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    updater = sr.weight_updater(model, 0, [dte.sglang.LOADER])
    with sr.as_rank(2, 1, 0):
        ok, _ = updater.update_weights_from_tensor(
            _serialized(dte.sglang.payload(publication=pub.publish_full()), False),
            load_format=dte.sglang.LOADER)
    assert ok  # SGLang itself reports success: dte's report says what happened
    rep = dte.sglang.report(model)
    assert rep["refused"].startswith("dte.UnsupportedError") and "gate_up_proj" in rep["refused"], rep
    assert all(torch.equal(p.view(torch.int16), before[n].view(torch.int16))
               for n, p in model.named_parameters())


def test_malformed_payloads_are_refused_by_name():
    model = sr.build("qwen3", 1, 1, 0)
    with sr.as_rank(1, 1, 0):
        dte.sglang.load(model, [("model.norm.weight", torch.zeros(64))])
        assert "give exactly one of" in dte.sglang.report(model)["refused"]
        dte.sglang.load(model, [(dte.sglang.PUBLICATION, torch.zeros(4, dtype=torch.float32))])
        assert "torch.uint8" in dte.sglang.report(model)["refused"]
        dte.sglang.load(model, dte.sglang.payload(storage="/nonexistent/dte-root"))
        assert "is not a directory" in dte.sglang.report(model)["refused"]
        # Not even an unexpected error reaches SGLang (it would end its scheduler).
        dte.sglang.load(model, [("no pair",)])
        assert dte.sglang.report(model)["refused"].startswith("dte.Error: unexpected ValueError")
    with pytest.raises(dte.InvalidArgument):
        dte.sglang.payload()


class EngineStandIn:
    """The process plumbing of an sglang.Engine started with custom_weight_loader=[dte's], in
    this process (a real Engine needs a GPU here): begin/end a weight-update session as SGLang's
    scheduler requires, serialize the list once per TP rank with SGLang's own
    Engine._serialize_tensors_per_rank, and let each rank deserialize its own copy (as
    TpModelWorker.deserialize_own_rank) into SGLang's own WeightUpdater."""

    def __init__(self, replica):
        self.replica = replica
        self.server_args = SimpleNamespace(tp_size=replica.tp)
        self.session = False

    def begin_weight_update(self):
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        from sglang.srt.entrypoints.engine import Engine

        rep = self.replica
        with sr.as_rank(rep.tp, rep.ep, 0):
            blobs = Engine._serialize_tensors_per_rank(self, named_tensors, load_format)
        return self.apply(blobs, load_format)

    def apply(self, blobs, load_format):
        from sglang.srt.utils.common import MultiprocessingSerializer

        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        rep = self.replica
        for r in range(rep.tp):
            with sr.as_rank(rep.tp, rep.ep, r):
                ok, text = rep.updaters[r].update_weights_from_tensor(
                    MultiprocessingSerializer.deserialize(blobs[r]), load_format=load_format)
                if not ok:
                    return ok, text
        return True, "Success"


class ServerStandIn(http.server.BaseHTTPRequestHandler):
    """SGLang's HTTP routes used by dte.sglang.update_server, over an EngineStandIn (the body's
    serialized_named_tensors are base64 text, which SGLang's serializer decodes)."""

    engine = None

    def do_GET(self):
        self._reply({"tp_size": self.engine.replica.tp} if self.path == "/get_server_info" else {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        e = self.engine
        if self.path == "/begin_weight_update":
            ok, text = e.begin_weight_update()
        elif self.path == "/end_weight_update":
            ok, text = e.end_weight_update()
        else:
            ok, text = e.apply(body["serialized_named_tensors"], body["load_format"])
        self._reply({"success": ok, "message": text}, 200 if ok else 400)

    def _reply(self, obj, code=200):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_trainer_side_calls_and_a_storage_root(tmp_path):
    """dte.sglang.update (Engine) and update_server (HTTP) carry publications and storage roots
    to every rank, and raise a worker's refusal from its report."""
    trainer = sr.Trainer("qwen3")
    config = sr.config_dict("qwen3")
    pub = dte.TorchPublisher(trainer.published, trainer.optimizer, config=config)
    replica = Replica("qwen3", 2, 1)
    engine = EngineStandIn(replica)
    ServerStandIn.engine = engine
    server = http.server.HTTPServer(("127.0.0.1", 0), ServerStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    root = tmp_path / "store"
    writer = dte.StorageWriter(root, config)
    try:
        full = pub.publish_full()
        writer.write(full)  # the root holds every version, from the first (full) one
        reports = dte.sglang.update(engine, publication=full)
        assert [r["version"] for r in reports] == [pub.version] * 2
        for step in range(6):
            trainer.step(step)
            message = pub.step()
            if step < 4:
                writer.write(message)
            if step in (0, 1):
                dte.sglang.update(engine, publication=message)
            elif step in (2, 3):
                reports = dte.sglang.update_server(url, publication=message, reports=tmp_path / "reports")
                assert [r["applied"] for r in reports] == [[pub.version]] * 2
            else:
                writer.write(message)  # the workers follow the root from the version they hold
                if step == 5:
                    reports = dte.sglang.update(engine, storage=root)
                    assert [r["applied"] for r in reports] == [[pub.version - 1, pub.version]] * 2
            if step != 4:
                replica.load_reference(trainer.bf16_weights())
                assert replica.mismatches() == []
        trainer.step(6)
        bad = bytearray(pub.step())
        bad[len(bad) // 2] ^= 0x40
        snap = replica.snapshot()
        with pytest.raises(dte.FormatError, match="TP worker 0 refused"):
            dte.sglang.update(engine, publication=bytes(bad))
        with pytest.raises(dte.FormatError):
            dte.sglang.update_server(url, publication=bytes(bad), reports=tmp_path / "reports")
        assert replica.unchanged_since(snap)
        # Without a reports directory the HTTP call cannot see the workers: it says so by None.
        assert dte.sglang.update_server(url, publication=bytes(bad)) is None
        assert replica.unchanged_since(snap)
    finally:
        server.shutdown()


def test_config_drift_version_and_outcome():
    """A publication of the same structure with another rope_theta or rms_norm_eps is refused at
    the first load by every rank, naming the field, nothing written (the loader binds to SGLang's
    own model config); dte.sglang.version asks the workers without updating; reports carry
    outcome."""
    trainer = sr.Trainer("qwen3")
    replica = Replica("qwen3", 2, 1)
    engine = EngineStandIn(replica)
    assert dte.sglang.version(engine) is None
    for field, value in (("rope_theta", 12345.0), ("rms_norm_eps", 1e-3)):
        drift = dte.TorchPublisher(trainer.published, trainer.optimizer,
                                   config={**sr.config_dict("qwen3"), field: value})
        snap = replica.snapshot()
        for r in replica.deliver(drift.publish_full()):
            assert r["outcome"] == "refused" and "dte.ProtocolError" in r["refused"], r
            assert f"{field} (the trainer's config: " in r["refused"], r
        assert replica.unchanged_since(snap)
    pub = dte.TorchPublisher(trainer.published, trainer.optimizer, config=sr.config_dict("qwen3"))
    full = pub.publish_full()
    assert [r["outcome"] for r in replica.deliver(full)] == ["committed"] * 2
    assert [r["outcome"] for r in replica.deliver(full)] == ["current"] * 2  # a re-delivery
    snap = replica.snapshot()
    assert dte.sglang.version(engine) == pub.version
    assert replica.unchanged_since(snap)
