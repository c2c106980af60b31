# SPDX-License-Identifier: Apache-2.0
"""The Python binding against real torch (issue 15): a tiny Qwen3-shaped model trained with
real autograd gradients by torch.optim; after every publication every receiver tensor equals
param.detach().to(torch.bfloat16) bit for bit: HF receivers, SGLang TP ranks (tp = 2, sliced
here independently of dte's C++ layout code), and readers of shared storage, one of them
lagging. Then the refusals, each leaving the receiver untouched."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
import dte  # noqa: E402
import tiny_qwen3  # noqa: E402
from tiny_qwen3 import CONFIG, TinyQwen3, batches  # noqa: E402

STEPS = 60


def bits(t):
    return t.detach().contiguous().view(torch.int16)


def served_like(model):
    """An inference copy: BF16 tensors of the HF names, holding garbage until the first apply."""
    return {n: torch.full(p.shape, float("nan"), dtype=torch.bfloat16) for n, p in model.named_parameters()}


def sglang_shard(model, tp, ts):
    """The expected SGLang shard of rank ts, sliced by hand (tiny_qwen3.sglang_shard)."""
    weights = {n: q.detach().to(torch.bfloat16) for n, q in model.named_parameters()}
    return tiny_qwen3.sglang_shard(weights, model.config, tp, ts)


def mismatches(model, served):
    bad = 0
    for n, q in model.named_parameters():
        bad += int((bits(served[n]) != bits(q.to(torch.bfloat16))).sum())
    return bad


def shard_mismatches(expected, shard):
    assert set(expected) == set(shard)
    return sum(int((bits(shard[n]) != bits(expected[n])).sum()) for n in expected)


def adamw(model, foreach, lr=3e-3):
    """Weight decay on matrices only, as RL trainers configure it."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=foreach)


def warmup_cosine(optimizer, warmup=5, total=STEPS):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def train(model, optimizer, pub, on_publication, steps=STEPS, clip=1.0, schedule=True):
    """The RL-style loop: backward, clip, step, schedule, zero_grad, then publish."""
    sched = warmup_cosine(optimizer, total=steps) if schedule else None
    published = 0
    for tokens in batches(model.config, steps=steps):
        model.loss(tokens).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if sched:
            sched.step()  # lr moves before pub.step(): dte must use the lr the step used
        optimizer.zero_grad()
        msg = pub.step()
        if msg is not None:
            published += 1
            on_publication(msg)
    return published


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_every_receiver_bit_identical(foreach, tmp_path):
    model = TinyQwen3()
    opt = adamw(model, foreach)
    pub = dte.TorchPublisher(model, opt, detect="bf16", publish_every=1)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    shards = [{n: torch.zeros(s, dtype=torch.bfloat16) for n, s in
               dte.TorchReceiver.shard_tensors(CONFIG, "tp=2", ts).items()} for ts in range(2)]
    ranks = [dte.TorchReceiver(shards[ts], config=CONFIG, infer="tp=2", rank=ts) for ts in range(2)]
    writer = dte.StorageWriter(tmp_path, CONFIG)
    near_t, lag_t = served_like(model), served_like(model)
    near = dte.TorchReceiver(near_t, config=CONFIG)
    lag = dte.TorchReceiver(lag_t, config=CONFIG)
    near_reader = dte.StorageReader(tmp_path, near)
    lag_reader = dte.StorageReader(tmp_path, lag, name="lagging")

    full = pub.publish_full()
    for r in [rx, *ranks]:
        assert r.apply(full)["full"]
    writer.write(full)
    assert near_reader.poll()["applied"] == [1]
    assert lag_reader.poll()["applied"] == [1]
    sent = []

    def check(msg):
        report = rx.apply(msg)
        assert report["outcome"] == "committed" and report["version"] == pub.version
        assert mismatches(model, served) == 0
        assert pub.digest() == rx.digest()
        for ts, r in enumerate(ranks):
            r.apply(msg)
            assert shard_mismatches(sglang_shard(model, 2, ts), shards[ts]) == 0
        assert dte.replica_matches(ranks, pub.digest())
        writer.write(msg)
        assert near_reader.poll()["applied"] == [pub.version]
        assert mismatches(model, near_t) == 0
        if pub.version % 7 == 0:  # the lagging reader catches up over several versions at once
            got = lag_reader.poll()["applied"]
            assert got and got[-1] == pub.version
            assert mismatches(model, lag_t) == 0
        sent.append(pub.report["changed"])

    assert train(model, opt, pub, check) == STEPS
    lag_reader.poll()
    assert mismatches(model, lag_t) == 0
    # The deltas are deltas: far fewer elements than the model, and never nothing.
    total = sum(p.numel() for p in model.parameters())
    assert all(0 < c < total for c in sent)
    assert sum(sent) < 0.9 * total * len(sent)


def test_publish_every_4():
    model = TinyQwen3(seed=2)
    opt = adamw(model, foreach=True)
    pub = dte.TorchPublisher(model, opt, publish_every=4)
    served = served_like(model)
    rx = dte.TorchReceiver(served, config=CONFIG)
    rx.apply(pub.publish_full())

    def check(msg):
        rx.apply(msg)
        assert mismatches(model, served) == 0
        assert pub.digest() == rx.digest()

    assert train(model, opt, pub, check) == STEPS // 4


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.01),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-4),
], ids=["adam-l2", "sgd-momentum", "sgd-dampening-wd"])
def test_other_optimizers(make):
    model = TinyQwen3(seed=3)
    opt = make(model.parameters())
    pub = dte.TorchPublisher(model, opt)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    rx.apply(pub.publish_full())

    def check(msg):
        rx.apply(msg)
        assert mismatches(model, served) == 0
        assert pub.digest() == rx.digest()

    assert train(model, opt, pub, check, steps=50) == 50


@pytest.mark.parametrize("make", [
    lambda model: adamw(model, foreach=False),
    lambda model: torch.optim.Adam(model.parameters(), lr=2e-3, weight_decay=0.01),
    lambda model: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
], ids=["adamw", "adam-l2", "sgd-momentum"])
def test_a_parameter_without_gradient_is_not_a_miss(make):
    """torch skips parameters whose grad is None: Adam's step count does not move, and SGD (which
    keeps no count) leaves its momentum buffer alone. Checked on an HF receiver (which would also
    refuse a wrong result by its digest) and bit for bit on SGLang tp=2 ranks, which cannot
    check alone: a wrong inverse there would be a silent miss."""
    model = TinyQwen3(seed=4)
    opt = make(model)
    pub = dte.TorchPublisher(model, opt)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    shards = []
    for ts in range(2):
        t = {n: torch.zeros(s, dtype=torch.bfloat16)
             for n, s in dte.TorchReceiver.shard_tensors(CONFIG, "tp=2", ts).items()}
        shards.append((t, dte.TorchReceiver(t, config=CONFIG, infer="tp=2", rank=ts)))
    msg = pub.publish_full()
    for rx_ in [rx] + [r for _, r in shards]:
        rx_.apply(msg)
    for i, tokens in enumerate(batches(model.config, steps=12)):
        model.loss(tokens).backward()
        if i % 3 == 1:
            model.lm_head.weight.grad = None  # this step leaves lm_head alone
        opt.step()
        opt.zero_grad(set_to_none=True)
        msg = pub.step()
        report = rx.apply(msg)
        assert (i % 3 == 1) == ("lm_head.weight" not in report["touched"])
        assert mismatches(model, served) == 0
        for ts, (t, r) in enumerate(shards):
            r.apply(msg)
            assert shard_mismatches(sglang_shard(model, 2, ts), t) == 0


def test_frozen_parameters():
    """Parameters outside the optimizer with requires_grad=False never change: sent in full once."""
    model = TinyQwen3(seed=5)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.norm.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    pub = dte.TorchPublisher(model, opt)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    rx.apply(pub.publish_full())
    frozen = bits(served["model.embed_tokens.weight"]).clone()
    for tokens in batches(model.config, steps=8):
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        rx.apply(pub.step())
        assert mismatches(model, served) == 0
    assert torch.equal(bits(served["model.embed_tokens.weight"]), frozen)
    unfrozen = TinyQwen3()
    with pytest.raises(dte.InvalidArgument, match="not in any of the optimizer"):
        dte.TorchPublisher(unfrozen, torch.optim.AdamW(list(unfrozen.parameters())[1:]))


# ---- refusals ----

def test_refused_optimizers_and_parameters():
    model = TinyQwen3()
    with pytest.raises(dte.UnsupportedError, match="amsgrad"):
        dte.TorchPublisher(model, torch.optim.AdamW(model.parameters(), amsgrad=True))
    with pytest.raises(dte.UnsupportedError, match="momentum"):
        dte.TorchPublisher(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(dte.UnsupportedError):
        dte.TorchPublisher(model, torch.optim.Adagrad(model.parameters()))
    with pytest.raises(dte.UnsupportedError, match="detect"):
        dte.TorchPublisher(model, torch.optim.AdamW(model.parameters()), detect="fp8")
    bf16 = TinyQwen3().to(torch.bfloat16)
    with pytest.raises(dte.InvalidArgument, match="bfloat16"):
        dte.TorchPublisher(bf16, torch.optim.AdamW(bf16.parameters()))
    with pytest.raises(dte.InvalidArgument, match="config"):
        dte.TorchPublisher(torch.nn.Linear(3, 3), torch.optim.AdamW(torch.nn.Linear(3, 3).parameters()))
    other = dict(CONFIG, num_hidden_layers=3)
    with pytest.raises(dte.InvalidArgument, match="missing"):
        dte.TorchPublisher(model, torch.optim.AdamW(model.parameters()), config=other)
    # dte.InvalidArgument is also a ValueError, and every refusal a dte.Error
    assert issubclass(dte.InvalidArgument, ValueError) and issubclass(dte.ProtocolError, dte.Error)


def test_refused_receiver_tensors_change_nothing():
    model = TinyQwen3()
    served = served_like(model)
    before = {n: t.clone() for n, t in served.items()}
    wrong_shape = dict(served, **{"lm_head.weight": torch.zeros(3, 64, dtype=torch.bfloat16)})
    with pytest.raises(dte.InvalidArgument, match="shape"):
        dte.TorchReceiver(wrong_shape, config=CONFIG)
    wrong_dtype = dict(served, **{"model.norm.weight": torch.zeros(64)})
    with pytest.raises(dte.InvalidArgument, match="bfloat16"):
        dte.TorchReceiver(wrong_dtype, config=CONFIG)
    missing = {n: t for n, t in served.items() if n != "model.norm.weight"}
    with pytest.raises(dte.InvalidArgument, match="missing"):
        dte.TorchReceiver(missing, config=CONFIG)
    # Learnt from the first message: refused then, untouched.
    opt = torch.optim.AdamW(model.parameters())
    pub = dte.TorchPublisher(model, opt)
    late = dte.TorchReceiver(wrong_shape)
    with pytest.raises(dte.InvalidArgument, match="shape"):
        late.apply(pub.publish_full())
    for n, t in served.items():
        assert torch.equal(bits(t), bits(before[n]))


def test_refused_messages_leave_the_receiver_untouched():
    model = TinyQwen3()
    opt = adamw(model, foreach=False)
    pub = dte.TorchPublisher(model, opt)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    v1 = pub.publish_full()
    it = batches(model.config, steps=3)

    def step():
        model.loss(next(it)).backward()
        opt.step()
        opt.zero_grad()
        return pub.step()

    v2, v3 = step(), step()

    def untouched(msg, error, match):
        held = rx.version
        copy = {n: t.clone() for n, t in served.items()}
        digest = rx.digest()
        with pytest.raises(error, match=match):
            rx.apply(msg)
        assert rx.version == held and rx.digest() == digest
        for n, t in served.items():
            assert torch.equal(bits(t), bits(copy[n]))

    untouched(v2, dte.ProtocolError, "full publication first")
    assert rx.apply(v1)["version"] == 1
    untouched(v3, dte.ProtocolError, "on base version 2 but this receiver holds 1")  # a message for another base
    corrupt = bytearray(v2)
    corrupt[-10] ^= 0x40
    untouched(bytes(corrupt), dte.FormatError, "checksum|zstd|corrupt")
    untouched(v2[:-7], dte.FormatError, "truncated|past the end")
    untouched(b"not a publication", dte.FormatError, "DTEPUB1")
    other = TinyQwen3(dict(CONFIG, intermediate_size=96))
    foreign = dte.TorchPublisher(other, torch.optim.AdamW(other.parameters())).publish_full()
    untouched(foreign, dte.ProtocolError, "model")
    assert rx.apply(v2)["outcome"] == "committed"
    assert rx.apply(v2)["outcome"] == "current"  # a re-delivery changes nothing
    untouched(v1, dte.ProtocolError, "older")
    assert rx.verify()
    served["lm_head.weight"].add_(1.0)  # written behind dte's back, where v3 writes too
    assert not rx.verify()
    untouched(v3, dte.ProtocolError, "digest")
    rx.apply(pub.publish_full())
    assert mismatches(model, served) == 0


def test_a_missed_publisher_step_forces_a_full_publication():
    model = TinyQwen3()
    opt = adamw(model, foreach=True)
    pub = dte.TorchPublisher(model, opt)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    rx.apply(pub.publish_full())
    it = batches(model.config, steps=6)
    for _ in range(2):  # two optimizer steps, one pub.step()
        model.loss(next(it)).backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(dte.ProtocolError, match="2 optimizer steps"):
        pub.step()
    with pytest.raises(dte.ProtocolError, match="0 optimizer steps"):
        pub.step()
    model.loss(next(it)).backward()
    opt.step()
    opt.zero_grad()
    msg = pub.step()
    assert rx.apply(msg)["full"]
    assert mismatches(model, served) == 0


@pytest.mark.parametrize("every", [1, 3])
def test_a_full_publication_in_the_middle(every):
    """publish_full() at any step (a receiver to resynchronise), then deltas again."""
    model = TinyQwen3(seed=7)
    opt = adamw(model, foreach=False)
    pub = dte.TorchPublisher(model, opt, publish_every=every)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    rx.apply(pub.publish_full())
    for i, tokens in enumerate(batches(model.config, steps=14)):
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        if i in (4, 8):
            rep = rx.apply(pub.publish_full())  # instead of this step's pub.step()
            assert rep["full"]
            assert mismatches(model, served) == 0
            continue
        msg = pub.step()
        if msg is not None:
            assert not rx.apply(msg)["full"]
            assert mismatches(model, served) == 0
    assert pub.digest() == rx.digest()


def test_a_restarted_trainer_continues_the_numbering(tmp_path):
    """Receivers and storage never move back: a new publisher continues after the last version."""
    model = TinyQwen3(seed=6)
    opt = adamw(model, foreach=True)
    pub = dte.TorchPublisher(model, opt)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    writer = dte.StorageWriter(tmp_path / "root", CONFIG)
    first = pub.publish_full()
    rx.apply(first)
    writer.write(first)
    it = batches(model.config, steps=6)
    for _ in range(3):
        model.loss(next(it)).backward()
        opt.step()
        opt.zero_grad()
        msg = pub.step()
        rx.apply(msg)
        writer.write(msg)
    del writer  # the trainer process ends: its writer lock goes with it
    restarted = dte.TorchPublisher(model, opt)  # numbering from 1 again: refused as older
    with pytest.raises(dte.ProtocolError, match=r"older.*continue_after=4\).*dte\.vllm\.version"):
        rx.apply(restarted.publish_full())
    resumed = dte.TorchPublisher(model, opt, continue_after=rx.version)
    writer = dte.StorageWriter(tmp_path / "root", CONFIG)
    model.loss(next(it)).backward()
    opt.step()
    opt.zero_grad()
    msg = resumed.step()
    assert rx.apply(msg)["full"] and rx.version == 5
    assert writer.write(msg)["version"] == 5
    assert mismatches(model, served) == 0


def test_parameters_are_read_where_they_live_each_step():
    """Nothing is moved or copied: a parameter whose .data is re-assigned is read at its new
    place; one re-assigned to a dtype dte cannot invert from is refused, naming it."""
    model = TinyQwen3()
    opt = torch.optim.AdamW(model.parameters())
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    pub = dte.TorchPublisher(model, opt)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    model.lm_head.weight.data = model.lm_head.weight.data.clone() * 2
    rx.apply(pub.publish_full())
    assert mismatches(model, served) == 0
    model.lm_head.weight.data = model.lm_head.weight.data.to(torch.bfloat16)
    with pytest.raises(dte.InvalidArgument, match="parameter of lm_head.weight is torch.bfloat16"):
        pub.publish_full()


def test_a_trainers_own_fp32_master_weights_beside_a_bf16_model():
    """Mixed precision without FSDP: the module computes in BF16, the optimizer steps FP32
    master copies; the publisher reads the masters (a dict of HF names), and receivers hold what
    the BF16 module computes with (the masters rounded), bit for bit."""
    model = TinyQwen3().to(torch.bfloat16)
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(masters.values(), lr=3e-3, weight_decay=0.1)
    with pytest.raises(dte.InvalidArgument, match="torch.float32"):
        dte.TorchPublisher(model, torch.optim.AdamW(model.parameters()))  # the BF16 copies: refused
    pub = dte.TorchPublisher(masters, opt, config=CONFIG)
    served = served_like(model)
    rx = dte.TorchReceiver(served)
    rx.apply(pub.publish_full())
    params = dict(model.named_parameters())
    published = 0
    for tokens in batches(model.config, steps=12):
        model.loss(tokens).backward()
        for n, m in masters.items():
            m.grad = params[n].grad.float()
            params[n].grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, m in masters.items():
                params[n].copy_(m)  # the BF16 compute copy, rounded to nearest even
        msg = pub.step()
        assert rx.apply(msg)["changed"] > 0
        assert mismatches(model, served) == 0
        published += 1
    assert published == 12 and pub.digest() == rx.digest()


def test_a_parameter_on_another_device_is_refused_by_name():
    """dte reads CPU and CUDA tensors (test_cuda.py); a parameter elsewhere (here the meta
    device, which every torch build has) is refused naming it, before anything else."""
    model = TinyQwen3()
    model.lm_head.weight = torch.nn.Parameter(torch.empty(model.lm_head.weight.shape, device="meta"))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(dte.UnsupportedError, match="parameter of lm_head.weight is on meta"):
        dte.TorchPublisher(model, opt)


@pytest.mark.parametrize("field,trainer,served", [("rope_theta", 1e6, 1e4),
                                                  ("rms_norm_eps", 1e-6, 1e-5)])
def test_config_drift_is_refused_by_name(field, trainer, served):
    """The same structure computing another function: a receiver bound to its config refuses a
    publication of another rope_theta or rms_norm_eps, naming the field and both values, before
    writing anything (HF receivers and TP ranks); a transformers-5 style rope_parameters of the
    same value is the same config."""
    model = TinyQwen3(seed=8)
    opt = adamw(model, foreach=True)
    pub = dte.TorchPublisher(model, opt, config={**CONFIG, field: trainer})
    full = pub.publish_full()
    served_t = served_like(model)
    shards = dte.TorchReceiver.allocate(CONFIG, "tp=2", 0)
    for rx, tensors in ((dte.TorchReceiver(served_t, config={**CONFIG, field: served}), served_t),
                        (dte.TorchReceiver(shards, config={**CONFIG, field: served}, infer="tp=2",
                                           rank=0), shards)):
        before = {n: t.clone() for n, t in tensors.items()}
        with pytest.raises(dte.ProtocolError, match=rf"{field} \(the trainer's config: "):
            rx.apply(full)
        assert rx.version is None
        assert all(torch.equal(bits(t), bits(before[n])) for n, t in tensors.items())
    same = {k: v for k, v in CONFIG.items() if k != "rope_theta"}
    if field == "rope_theta":
        same["rope_parameters"] = {"rope_type": "default", "rope_theta": trainer}
    else:
        same[field] = trainer
    rx = dte.TorchReceiver(served_like(model), config=same)
    assert rx.apply(full)["outcome"] == "committed"
    assert dte._native.config_difference(
        __import__("json").dumps({**CONFIG, field: trainer}), __import__("json").dumps(same),
        "a", "b") == ""
