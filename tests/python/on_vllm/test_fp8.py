# SPDX-License-Identifier: Apache-2.0
"""FP8 receivers (docs/fp8.md) against vLLM's own online quantization.

vLLM's CPU engine cannot serve online FP8 here (quantization="fp8" needs the CUDA kernel
static_scaled_fp8_quant; "fp8_per_block" finds no ScaledMM kernel for the CPU), so the oracle is
the function vLLM 0.32 runs on each worker's weight when it loads BF16 weights into an
Fp8PerBlockOnlineLinearMethod layer: vllm.utils.deep_gemm.per_block_cast_to_fp8(weight,
[128, 128], use_ue8m0=False), imported from the installed package and run on CPU torch, over
each TP rank's BF16 tensors as vLLM's layers hold them (common.vllm_rank_tensors, sliced
independently of dte). After every publication of real torch.optim.AdamW steps, every tensor of
every rank must equal it bit for bit: codes, scales, and the tensors that stay BF16.
"""
import pytest
import torch

import dte
from dte import _native

from common import adamw, make_trainer, train_step, vllm_rank_tensors

per_block_cast_to_fp8 = pytest.importorskip("vllm.utils.deep_gemm").per_block_cast_to_fp8

# Several 128 x 128 blocks per tensor, cut by the tensor's edge: qkv 384 x 192 at tp=1,
# gate_up 640 x 192, down 192 x 320.
SHAPE = dict(hidden_size=192, intermediate_size=320, head_dim=48)
QUANTIZED = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def engine_tensors(model, tp, rank):
    """What vLLM's online per-block FP8 holds on TP rank `rank` for the trainer's weights."""
    out = {}
    for name, t in vllm_rank_tensors(model, tp, rank).items():
        if name.endswith(QUANTIZED):
            q, s = per_block_cast_to_fp8(t, [128, 128], use_ue8m0=False)
            out[name] = q
            out[name + "_scale_inv"] = s
        else:
            out[name] = t
    return out


def bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def mismatches(held, expected):
    bad = sorted(set(held) ^ set(expected))
    for name, t in expected.items():
        h = held.get(name)
        if h is None:
            continue
        if h.dtype != t.dtype or h.shape != t.shape or not torch.equal(bits(h), bits(t)):
            bad.append(name)
    return bad


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("every", [1, 4])
def test_fp8_ranks_equal_vllm_requantization(tp, every):
    model = make_trainer(seed=5, **SHAPE)
    optimizer = adamw(model, lr=1e-5)
    infer = f"tp={tp}"
    pub = dte.TorchPublisher(model, optimizer, publish_every=every, quantization="fp8-block",
                             infer=infer)
    tensors = [dte.TorchReceiver.allocate(model.config, infer, r, "fp8-block") for r in range(tp)]
    rx = [dte.TorchReceiver(tensors[r], config=model.config, infer=infer, rank=r,
                            quantization="fp8-block") for r in range(tp)]

    def apply(msg):
        for r in range(tp):
            rx[r].apply(msg)
            assert mismatches(tensors[r], engine_tensors(model, tp, r)) == [], f"rank {r}"
            assert rx[r].verify()

    apply(pub.publish_full())
    published, step, codes, changed, fp8_bytes = 0, 0, 0, 0, 0
    while published < 30:
        train_step(model, optimizer, step)
        step += 1
        msg = pub.step()
        if msg is None:
            continue
        apply(msg)
        published += 1
        report = pub.report
        codes += report["fp8_codes"]
        changed += report["changed"]
        fp8_bytes += len(msg)
    assert step == 30 * every
    # what the receivers serve moved: the test is not vacuous
    assert codes > 0
    assert codes < changed


def test_fp8_recipe_equals_torch_on_every_bf16_value():
    """The recipe's rule (scale from amax, reciprocal, FP32 product, torch's E4M3FN conversion)
    on all 65,536 BF16 bit patterns at several scales, against the same arithmetic in torch
    (which is per_block_cast_to_fp8's)."""
    every = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every[torch.isfinite(every.float())]
    for amax in [0.0, 1e-5, 1e-4, 3e-4, 0.0125, 0.4375, 1.0, 3.14159, 448.0, 60000.0, 3e38]:
        scale, codes = _native.fp8_recipe("fp8-block", finite.view(torch.int16).numpy().tobytes(), amax)
        sf = torch.tensor([[amax]], dtype=torch.float32).clamp(1e-4) / 448.0
        assert scale == sf.item()
        want = (finite.view(1, -1) * (1.0 / sf)).to(torch.float8_e4m3fn).view(torch.uint8)
        got = torch.frombuffer(bytearray(codes), dtype=torch.uint8)
        diff = (want.view(-1) != got).nonzero()
        assert diff.numel() == 0, (amax, finite[diff[:5].view(-1)].tolist())


def test_fp8_refusals():
    model = make_trainer(seed=6, **SHAPE)
    optimizer = adamw(model)
    pub = dte.TorchPublisher(model, optimizer, quantization="fp8-block", infer="tp=2")
    full = pub.publish_full()
    # a BF16 receiver refuses an FP8 publication, an FP8 one of another TP size too
    plain = dte.TorchReceiver(dte.TorchReceiver.allocate(model.config, "tp=2", 0),
                              config=model.config, infer="tp=2", rank=0)
    with pytest.raises(dte.FormatError, match="FP8"):
        plain.apply(full)
    other = dte.TorchReceiver(dte.TorchReceiver.allocate(model.config, "tp=1", 0, "fp8-block"),
                              config=model.config, infer="tp=1", quantization="fp8-block")
    with pytest.raises(dte.FormatError, match="tp=2"):
        other.apply(full)
    # wrong dtypes are refused by name, before anything is held
    t = dte.TorchReceiver.allocate(model.config, "tp=2", 0, "fp8-block")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    t[name] = torch.zeros(t[name].shape, dtype=torch.bfloat16)
    with pytest.raises(dte.InvalidArgument, match=name):
        dte.TorchReceiver(t, config=model.config, infer="tp=2", quantization="fp8-block")
    with pytest.raises(dte.UnsupportedError, match="per-tensor"):
        dte.TorchReceiver.allocate(model.config, "tp=2", 0, "fp8-per-tensor")
    with pytest.raises(dte.InvalidArgument, match="quantization"):
        dte.TorchPublisher(model, optimizer, infer="tp=2")
