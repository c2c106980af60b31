# SPDX-License-Identifier: Apache-2.0
"""dte.TorchPublisher over CUDA tensors (issue 29): the detect pass runs on the GPU and only the
changed elements come to the host. Needs a GPU that torch sees and a dte._native built with
nvcc; skipped elsewhere (bench/gpu/run.sh runs it the day a GPU is lent).

The tiny Qwen3 trains on the GPU with real autograd gradients and real torch.optim steps; after
every optimizer step a CPU mirror (the same weights and optimizer state, copied) is published
by the host path. The GPU publisher's messages must equal the host's byte for byte, and a
receiver fed them must hold param.to(torch.bfloat16) bit for bit after every publication.
The same tests also run with the model on the CPU (the mirror then checks the harness itself,
everywhere); without a GPU only those and the refusals run."""
import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
import dte  # noqa: E402
from dte import sharded  # noqa: E402
from tiny_qwen3 import CONFIG, TinyQwen3, batches  # noqa: E402

HAVE_GPU = torch.cuda.is_available() and dte._native.cuda_built
gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device torch can use, or dte built without nvcc")
STEPS = 24


def bits(t):
    return t.detach().contiguous().view(torch.int16)


def optimizer(kind, model, frozen=()):
    named = [(n, p) for n, p in model.named_parameters() if n not in frozen]
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), foreach=True)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-3, foreach=False)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def mirror(model, opt, cpu_model, cpu_opt):
    """The CPU copy takes the GPU's weights, gradients and optimizer state as they are now."""
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), cpu_model.named_parameters()):
            q.copy_(p.cpu())
            q.grad = None if p.grad is None else p.grad.cpu()
            st = opt.state.get(p)
            if st:
                cpu_opt.state[q] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                    for k, v in st.items()}


DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,K,encoding,frozen", [
    ("adamw", 1, "diff", ()),
    ("adamw", 1, "value", ()),
    ("adamw", 4, "diff", ("model.norm.weight",)),
    ("adam", 1, "diff", ()),
    ("sgd", 1, "diff", ()),
])
def test_gpu_messages_are_the_hosts_and_receivers_bit_identical(kind, K, encoding, frozen, device):
    device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    model = TinyQwen3().to(device)
    cpu_model = TinyQwen3()
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    for n in frozen:
        model.get_parameter(n).requires_grad_(False)
        cpu_model.get_parameter(n).requires_grad_(False)
    opt, cpu_opt = optimizer(kind, model, frozen), optimizer(kind, cpu_model, frozen)
    pub = dte.TorchPublisher(model, opt, publish_every=K, encoding=encoding)
    host = dte.TorchPublisher(cpu_model, cpu_opt, publish_every=K, encoding=encoding)
    served = {n: torch.full(p.shape, float("nan"), dtype=torch.bfloat16) for n, p in model.named_parameters()}
    rx = dte.TorchReceiver(served)

    def check(msg, want):
        assert msg == want
        assert rx.apply(msg)["outcome"] == "committed"
        for n, p in model.named_parameters():
            assert bool((bits(served[n]) == bits(p.to(torch.bfloat16).cpu())).all()), n
        assert pub.digest() == rx.digest() == host.digest()

    check(pub.publish_full(), host.publish_full())
    side = torch.cuda.Stream(device) if cuda else None
    published = 0
    for i, tokens in enumerate(batches(CONFIG, steps=STEPS)):
        # every other step on a side stream: the publisher waits for the stream the step ran on
        stream = (side if i % 2 else torch.cuda.default_stream(device)) if cuda else None
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            model.loss(tokens.to(device)).backward()
            opt.step()
            mirror(model, opt, cpu_model, cpu_opt)
            host._after_optimizer_step()  # (the mirror's optimizer did not step: its hook, by hand)
            opt.zero_grad()
            msg = pub.step()
        want = host.step()
        assert (msg is None) == (want is None)
        if msg is not None:
            check(msg, want)
            published += 1
    assert published == STEPS // K
    assert pub.report["changed"] > 0 and pub.report["scanned"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_gpu_refusal_then_full(device):
    """A negative second moment on the GPU: the publication is refused, nothing is applied, and
    the next one is full and exact."""
    device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    model = TinyQwen3().to(device)
    opt = optimizer("adamw", model)
    pub = dte.TorchPublisher(model, opt)
    served = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in model.named_parameters()}
    rx = dte.TorchReceiver(served)
    rx.apply(pub.publish_full())
    data = batches(CONFIG, steps=3)
    model.loss(next(data).to(device)).backward()
    opt.step()
    opt.zero_grad()
    v = opt.state[model.lm_head.weight]["exp_avg_sq"]
    saved = v[0, 0].item()
    v[0, 0] = -1.0
    with pytest.raises(dte.InvalidArgument, match="lm_head.weight"):
        pub.step()
    v[0, 0] = saved
    model.loss(next(data).to(device)).backward()
    opt.step()
    opt.zero_grad()
    report = rx.apply(pub.step())
    assert report["full"] and report["version"] == 2
    for n, p in model.named_parameters():
        assert bool((bits(served[n]) == bits(p.to(torch.bfloat16).cpu())).all()), n


class _Slot:
    def __init__(self, name, device):
        self.name = name
        self._t = torch.empty(0, device=device)

    def local(self):
        return self._t


def test_device_of_refuses_what_it_cannot_read():
    """One device per rank, CPU or CUDA, and CUDA only in a build with nvcc (the slots stand in
    for a rank's tensors: torch.device('cuda', 0) needs no GPU, a tensor on it would)."""
    class Cuda(_Slot):
        def __init__(self, name, index):
            self.name = name
            self.device = torch.device("cuda", index)

        def local(self):
            return self

    cpu = _Slot("model.norm.weight", "cpu")
    assert sharded.device_of([cpu, cpu], True) == torch.device("cpu")
    assert sharded.device_of([Cuda("lm_head.weight", 1)], True) == torch.device("cuda", 1)
    with pytest.raises(dte.UnsupportedError, match="lm_head.weight is on cuda:0: this dte._native was built without CUDA"):
        sharded.device_of([Cuda("lm_head.weight", 0)], False)
    with pytest.raises(dte.InvalidArgument, match="model.norm.weight is on cpu and parameter of lm_head.weight on cuda:0"):
        sharded.device_of([cpu, Cuda("lm_head.weight", 0)], True)
    with pytest.raises(dte.UnsupportedError, match="lm_head.weight is on meta"):
        sharded.device_of([cpu, _Slot("lm_head.weight", "meta")], True)


@pytest.mark.skipif(HAVE_GPU and torch.cuda.device_count() > 7, reason="needs a device index this process lacks")
def test_a_cuda_device_the_process_lacks_is_refused():
    """The native publisher on a CUDA device this process does not have: refused by name, in a
    build with CUDA (the device count) and without (the build)."""
    expected = "sees [0-9]+ CUDA device" if dte._native.cuda_built else "built without CUDA"
    with pytest.raises(dte.UnsupportedError, match=expected):
        dte._native.Publisher("adamw", dte._config_text(CONFIG), 1, 1, True, [(0, 0, 1, True, 0, 0)],
                              [1], [0], True, 0, 1, 7)
