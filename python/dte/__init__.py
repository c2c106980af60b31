# SPDX-License-Identifier: Apache-2.0
"""dte: keep BF16 inference weights in sync with a PyTorch trainer by sending only what changed.

    pub = dte.TorchPublisher(model, optimizer, detect="bf16", publish_every=1)
    rx = dte.TorchReceiver({name: t for name, t in served.named_parameters()})
    rx.apply(pub.publish_full())
    ... optimizer.step(); msg = pub.step()   # bytes every publish_every steps, else None
    if msg is not None: rx.apply(msg)

The previous weights are reconstructed from the optimizer's own state (no snapshot); the
messages are self-contained byte strings in HF coordinates, so receivers of any layout (HF
tensors, an SGLang tensor-parallel rank, shared storage) apply the same bytes. docs/python.md
has the whole story.
"""
from __future__ import annotations

import json
import os
import re
import types
from typing import Dict, List, Mapping, Optional, Sequence

from . import _native, sharded
from ._native import (  # noqa: F401  (the exception classes, dte/error.hpp)
    BoundsError,
    DeadlineError,
    Error,
    FormatError,
    InvalidArgument,
    IoError,
    NumericError,
    ProtocolError,
    UnsupportedError,
)

__all__ = [
    "TorchPublisher",
    "TorchReceiver",
    "StorageWriter",
    "StorageReader",
    "replica_matches",
    "Error",
    "InvalidArgument",
    "BoundsError",
    "NumericError",
    "UnsupportedError",
    "FormatError",
    "ProtocolError",
    "IoError",
    "DeadlineError",
]


def _torch():
    import torch  # imported lazily: `import dte` works without torch

    return torch


def _config_text(config, model=None) -> str:
    """The model's config as dte._native reads it: a preset name or config.json text."""
    if config is None and model is not None:
        config = getattr(model, "config", None)
    if config is None:
        raise InvalidArgument(
            "dte needs the model's config (its config.json): pass config= (a dict, a path to "
            "config.json, a transformers config or a dte preset name such as 'small-qwen3'), or "
            "give the model a .config attribute"
        )
    if isinstance(config, str):
        if os.path.isdir(config):
            config = os.path.join(config, "config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                return f.read()
        return config  # a preset name; _native refuses an unknown one by name
    if hasattr(config, "to_dict"):  # transformers.PretrainedConfig
        config = config.to_dict()
    if isinstance(config, Mapping):
        return json.dumps(dict(config))
    raise InvalidArgument(f"config must be a dict, a path, a preset name or a transformers config, not {type(config).__name__}")


def _infer(infer) -> tuple:
    """An inference topology: 'tp=2', 'tp=4,ep=2', {'tp': 2} or an int (tp)."""
    if infer is None:
        return None
    if isinstance(infer, int):
        return (infer, 1)
    if isinstance(infer, str):
        fields = {}
        for part in infer.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in ("tp", "ep") or not value.isdigit():
                raise InvalidArgument(f"infer={infer!r}: write it as 'tp=N' or 'tp=N,ep=M'")
            fields[key] = int(value)
        infer = fields
    if isinstance(infer, Mapping):
        unknown = set(infer) - {"tp", "ep"}
        if unknown:
            raise InvalidArgument(f"infer: unknown fields {sorted(unknown)} (tp and ep only)")
        return (int(infer.get("tp", 1)), int(infer.get("ep", 1)))
    raise InvalidArgument(f"infer must be 'tp=N[,ep=M]', a dict or an int, not {type(infer).__name__}")


class TorchPublisher:
    """The trainer side: one publication per version, from one process or from every rank of a
    sharded trainer.

    model: a torch.nn.Module whose named_parameters() are the HF tensors of its config (wrapper
    prefixes such as DDP's 'module.' or FSDP1's '_fsdp_wrapped_module.' are dropped), as FP32
    master weights: plain tensors, FSDP2 / tensor-parallel DTensors, or FSDP1 original
    parameters (use_orig_params=True). A trainer that computes in BF16 and keeps its own FP32
    master weights for the optimizer passes those instead: a dict HF name -> FP32 tensor (the
    optimizer's parameters), with config=. optimizer: torch.optim.AdamW, torch.optim.Adam (L2
    weight decay) or torch.optim.SGD with momentum over those parameters, or a
    ZeroRedundancyOptimizer around one. Each rank's weights and optimizer state are read where
    they live (dte/sharded.py), every step: nothing is copied or moved. They live on the CPU or
    on one CUDA device per rank: on a GPU the detect pass runs there (the package built with
    nvcc: dte._native.cuda_built) and only the changed elements come to the host.

    Call step() after every optimizer.step(): it returns the next publication (bytes) every
    publish_every steps, else None. publish_full() returns a full one at any time.

    Sharded trainers: once torch.distributed is initialised with more than one rank, make the
    publisher on every rank of the trainer's process group (group=, default the whole world)
    and call step() / publish_full() on every rank alike. Each rank detects the changes of the
    elements it holds; the ranks' parts are gathered and the whole publication comes back on
    group rank dst (default 0), None on the others. A refusal on any rank raises on every rank
    (the rank's own error, or one of the same class naming the rank that refused), and the next
    publication is full on all. One small collective runs per step(), and two more per
    publication. The pieces every rank holds are checked at construction: each element of the
    model has exactly one sender.

    encoding: 'diff' (default): a delta covering one optimizer step codes each changed element
    against the value its receivers hold (a one-ulp step takes a few bits; about 1.4 bytes per
    changed element at 1 % changed against 2.4 for values, for an apply about 15 % slower);
    'value': the new BF16 bits. Full publications, and deltas over publish_every > 1 steps,
    carry values either way.

    continue_after: a trainer that restarted continues the version numbering its receivers and
    storage root follow (give the last version published, e.g. a receiver's rx.version or the
    root's LATEST): its first publication is then that + 1, full. Receivers never move back, so
    a restarted publisher starting again at 1 would be refused.

    quantization: receivers that serve online-quantized FP8 (docs/fp8.md), e.g. 'fp8-block'
    (vLLM's per-block recipe), at the TP size infer= ('tp=N'; default 1): each publication then
    carries, per TP rank, the FP8 codes and block scales that change, bit-identical to the
    engine's own requantization, and the tensors that stay BF16 as usual; receivers are
    TorchReceiver(..., quantization=..., infer=..., rank=...). One process holding the whole
    model on the CPU.
    """

    def __init__(self, model, optimizer, detect: str = "bf16", publish_every: int = 1,
                 config=None, zstd_level: int = 1, continue_after: int = 0,
                 encoding: str = "diff", group=None, dst: int = 0,
                 quantization: Optional[str] = None, infer=None):
        if detect != "bf16":
            raise UnsupportedError(f"detect={detect!r}: the Python binding publishes BF16 (detect='bf16')")
        if encoding not in ("diff", "value"):
            raise InvalidArgument(f"encoding={encoding!r}: 'diff' (the default) or 'value'")
        if not isinstance(publish_every, int) or publish_every < 1:
            raise InvalidArgument(f"publish_every must be an integer >= 1, not {publish_every!r}")
        self._config = _config_text(config, model)
        info = _native.model_info(self._config)
        self.names: List[str] = info["names"]
        self._group, self._rank, self._world = _process_group(group)
        if not 0 <= dst < self._world:
            raise InvalidArgument(f"dst={dst} is not a rank of the trainer's group ({self._world} ranks)")
        self._dst = dst
        inner = sharded.inner_optimizer(optimizer)
        self._slots = sharded.slots(model, info["names"], info["shapes"], self._rank,
                                    sharded.zero_owner(optimizer))
        # one device for all of this rank's tensors: the CPU, or a CUDA device (the detect pass
        # runs there and only the changed elements come to the host)
        self._device = sharded.device_of(self._slots, _native.cuda_built)
        kind, slot_group = _optimizer_kind(inner, model, self._slots)
        self._kind = kind
        self._optimizer = inner
        pieces = [(s.tensor, i, n, sender, k, off)
                  for k, s in enumerate(self._slots) for (i, n, off, sender) in s.pieces]
        mine = [(t, i, n, sender) for (t, i, n, sender, _, _) in pieces]
        # Every element once among the ranks' senders, checked on every rank alike (so all
        # raise together) before anything is published.
        _native.check_writers(self._config, self._all_gather(mine))
        self._native = _native.Publisher(
            kind, self._config, publish_every, zstd_level, encoding == "diff", pieces,
            [s.numel for s in self._slots], slot_group, kind == "adamw", self._rank, self._world,
            -1 if self._device.type == "cpu" else self._device.index)
        if quantization is not None:
            if self._world > 1:
                raise UnsupportedError("quantization=: FP8 receivers are served by one process holding the whole model; sharded trainers are not covered yet (docs/fp8.md)")
            tp, ep = _infer(infer) or (1, 1)
            self._native.serve_fp8(str(quantization), tp, ep)
        elif infer is not None:
            raise InvalidArgument("infer= names the TP size of FP8 receivers; give quantization= with it (BF16 publications serve every topology)")
        if continue_after:
            self._native.continue_after(int(continue_after))
        self._seen = 0  # optimizer steps since the last step()
        self._used = None  # the groups' hyperparameters as the last optimizer step used them
        # SGD keeps no step count: the updates of each slot, counted here (a parameter without
        # a gradient is skipped by the step, and must stay known unchanged)
        self._sgd_steps = [0] * len(self._slots)
        self._digest = ()  # the whole publication's (group rank dst, several ranks)
        self._message = None  # the whole publication's bytes and changed elements (dst)
        # The optimizer may have stepped before (a resumed run): its step counts are the start.
        self._native.resync(self._gather()[3], False)
        _hook_optimizer(inner, self._after_optimizer_step)

    # -- what the optimizer step used (before any scheduler moves lr) --
    def _after_optimizer_step(self):
        self._seen += 1
        if self._kind == "sgd":
            # torch.optim.SGD updates exactly the parameters that have a gradient (and, from
            # their first update on, a momentum buffer); the gradients are still there now
            state = self._optimizer.state
            for k, slot in enumerate(self._slots):
                st = state.get(slot.param)
                if slot.param.grad is not None and st and st.get("momentum_buffer") is not None:
                    self._sgd_steps[k] += 1
        used = []
        for g in self._optimizer.param_groups:
            betas = g.get("betas", (0.9, 0.999))
            used.append(_native.Group(float(g["lr"]), float(g.get("weight_decay", 0.0)),
                                      float(betas[0]), float(betas[1]), float(g.get("eps", 1e-8)),
                                      float(g.get("momentum", 0.0)), float(g.get("dampening", 0.0))))
        self._used = used

    @property
    def version(self) -> int:
        """The version of the last publication (0: none yet)."""
        return self._native.version

    @property
    def rank(self) -> int:
        """This publisher's rank in the trainer's group (0 in one process)."""
        return self._rank

    @property
    def report(self) -> dict:
        """What the last publication did on this rank (version, changed, scanned, bytes of its
        part, seconds, ...); on the group's dst rank of a sharded trainer also 'message_bytes'
        and 'message_changed', the whole publication's."""
        r = self._native.last()
        if self._message is not None:
            r["message_bytes"], r["message_changed"] = self._message
        return r

    def digest(self) -> tuple:
        """Per HF tensor, the digest of the trainer's BF16 state as of the last publication
        (sharded: on the group's dst rank, which holds the whole publication)."""
        if self._world == 1:
            return tuple(self._native.digest())
        if self._rank != self._dst:
            raise InvalidArgument(
                f"digest(): rank {self._rank} holds its part only; the whole digest is on group "
                f"rank {self._dst}")
        return tuple(self._digest)

    def publish_full(self) -> Optional[bytes]:
        """Every element, now (the first publication, or to resynchronise a receiver)."""
        def run():
            theta, _, _, steps = self._gather()
            out = self._native.publish_full(theta, self._stream())
            self._native.resync(steps, False)  # the next step() inverts the step after this one
            return out

        out = self._agree(run)
        self._seen = 0
        return out

    def step(self) -> Optional[bytes]:
        """After each optimizer.step(): the next publication every publish_every steps, else None."""
        def run():
            if self._seen != 1:
                seen, self._seen = self._seen, 0
                self._native.resync(self._gather()[3], True)
                raise ProtocolError(
                    f"TorchPublisher.step(): {seen} optimizer steps ran since the last call; dte "
                    "inverts exactly one, so call pub.step() after every optimizer.step(). The next "
                    "publication will be full")
            self._seen = 0
            theta, a, b, steps = self._gather()
            return self._native.step(self._used, theta, a, b, steps, self._stream())

        return self._agree(run)

    # -- one version across the trainer's ranks --
    def _agree(self, run) -> Optional[bytes]:
        """run() on this rank (its part, or None between publications); then, with several
        ranks, every rank learns every rank's outcome: all commit the merged publication (on
        dst) or all abort, and the next one is full."""
        err = None
        part = None
        try:
            part = run()
        except Exception as e:  # noqa: BLE001 (any failure here must reach the other ranks,
            err = e             # or they would wait in the collective below)
        if self._world == 1:
            if err is not None:
                raise err
            return part
        status = self._all_gather((err is None, type(err).__name__ if err else "",
                                   str(err) if err else "", part is not None))
        failed = [(r, s) for r, s in enumerate(status) if not s[0]]
        if failed or len({s[3] for s in status}) != 1:
            self._native.abort()
            if err is not None:
                raise err
            if not failed:
                raise ProtocolError(
                    "the trainer's ranks disagree on whether this step publishes (their "
                    "publish_every or their calls differ); no publication, the next one is full")
            r, (_, cls, text, _) = failed[0]
            raise _error_class(cls)(
                f"trainer rank {r} refused this publication: {text} (nothing was published; the "
                "next publication is full on every rank)")
        if part is None:
            return None
        parts = self._gather_to_dst(part)
        merged, problem = None, None
        if parts is not None:
            try:
                merged, digest, changed = _native.merge(self._config, parts)
            except Exception as e:  # noqa: BLE001 (every rank must learn it)
                problem = (type(e).__name__, str(e))
        problem = self._broadcast_from_dst(problem)
        if problem is not None:
            self._native.abort()
            raise _error_class(problem[0])(
                f"group rank {self._dst} could not merge the ranks' parts: {problem[1]} (nothing "
                "was published; the next publication is full on every rank)")
        self._native.commit()
        if merged is None:
            return None
        self._digest = digest
        self._message = (len(merged), changed)
        return merged

    def _all_gather(self, obj) -> list:
        if self._world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return group_rank if self._group is None else dist.get_global_rank(self._group, group_rank)

    def _gather_to_dst(self, obj):
        import torch.distributed as dist

        out = [None] * self._world if self._rank == self._dst else None
        dist.gather_object(obj, out, dst=self._global(self._dst), group=self._group)
        return out

    def _broadcast_from_dst(self, obj):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._global(self._dst), group=self._group)
        return box[0]

    def _stream(self) -> int:
        """The stream the optimizer step ran on (CUDA: the device's current stream, which the
        native side waits for before it reads), 0 on the CPU."""
        if self._device.type == "cpu":
            return 0
        return _torch().cuda.current_stream(self._device).cuda_stream

    def _gather(self):
        """Per slot: the weights' and the state's addresses (0: none) and its step count."""
        torch = _torch()
        state = self._optimizer.state
        theta: List[int] = []
        a: List[int] = []
        b: List[int] = []
        steps: List[int] = []
        sgd = self._kind == "sgd"
        for k, slot in enumerate(self._slots):
            x = slot.local()
            sharded.check_local(slot, x, "parameter", self._device)
            theta.append(x.data_ptr())
            st = state.get(slot.param)
            if not st:
                a.append(0)
                b.append(0)
                steps.append(self._sgd_steps[k] if sgd else 0)
                continue
            if sgd:
                buf = st.get("momentum_buffer")
                if buf is None:
                    a.append(0)
                    b.append(0)
                    steps.append(self._sgd_steps[k])
                    continue
                buf = sharded.local_of(buf)
                sharded.check_local(slot, buf, "optimizer state momentum_buffer", self._device)
                a.append(buf.data_ptr())
                b.append(0)
                steps.append(self._sgd_steps[k])
            else:
                m = sharded.local_of(st["exp_avg"])
                v = sharded.local_of(st["exp_avg_sq"])
                sharded.check_local(slot, m, "optimizer state exp_avg", self._device)
                sharded.check_local(slot, v, "optimizer state exp_avg_sq", self._device)
                a.append(m.data_ptr())
                b.append(v.data_ptr())
                s = st["step"]
                if isinstance(s, torch.Tensor):
                    s = sharded.local_of(s).item()
                steps.append(int(s))
        return theta, a, b, steps


def _process_group(group):
    """(group, rank, world): torch.distributed's group when it is initialised, else one process."""
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise InvalidArgument("group= needs torch.distributed initialised (init_process_group)")
        return None, 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise InvalidArgument("this process is not a member of the group= given to TorchPublisher")
    return group, rank, dist.get_world_size(group)


def _error_class(name: str):
    cls = globals().get(name)
    return cls if isinstance(cls, type) and issubclass(cls, Error) else Error


def _error_from_text(text: str, prefix: str = "") -> Exception:
    """A serving worker's dte error from the text its report recorded ("dte.FormatError: ..."):
    the same class in every process; RuntimeError when the text names no dte class."""
    m = re.match(r"dte\.(\w+): (.*)", text, re.S)
    cls = globals().get(m.group(1)) if m else None
    if not (isinstance(cls, type) and issubclass(cls, Error)):
        return RuntimeError(prefix + text)
    return cls(prefix + m.group(2))


def _match_parameters(named: Mapping[str, object], info: dict, who: str) -> list:
    """The tensors of `named` in the model's canonical order, every name and shape checked."""
    names, shapes = info["names"], info["shapes"]
    sharded.check_names(named, names, f"{who}: the tensors do not match the model's config ({info['structure']})")
    out = []
    for n, shape in zip(names, shapes):
        t = named[n]
        if list(t.shape) != list(shape):
            raise InvalidArgument(
                f"{who}: tensor {n} has shape {tuple(t.shape)}, the model's config says {tuple(shape)}")
        out.append(t)
    return out


def _optimizer_kind(optimizer, model, slots):
    """Which inverse, and each slot's parameter group (-1: frozen); refuses what cannot be
    inverted."""
    torch = _torch()
    if isinstance(optimizer, torch.optim.AdamW):
        kind = "adamw"
    elif isinstance(optimizer, torch.optim.Adam):
        kind = "adam"
    elif isinstance(optimizer, torch.optim.SGD):
        kind = "sgd"
    else:
        raise UnsupportedError(
            f"{type(optimizer).__name__}: dte inverts torch.optim.AdamW, torch.optim.Adam and "
            "torch.optim.SGD with momentum (or a ZeroRedundancyOptimizer around one)")
    where: Dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad", False):
            raise UnsupportedError(
                "amsgrad=True: the step divides by max_exp_avg_sq's running maximum, which dte does "
                "not invert; use amsgrad=False")
        if group.get("maximize", False):
            raise UnsupportedError("maximize=True is not supported; minimise the negated objective")
        if kind == "sgd":
            if group.get("nesterov", False):
                raise UnsupportedError("SGD(nesterov=True) cannot be inverted: the gradient is not stored")
            if not group.get("momentum", 0.0) > 0.0:
                raise UnsupportedError(
                    "SGD without momentum keeps no state to invert; use momentum > 0 (e.g. 0.9)")
        for p in group["params"]:
            where[id(p)] = g
    known = {id(p) for _, p in sharded.named_tensors(model)}
    if any(i not in known for i in where):
        raise InvalidArgument("the optimizer updates tensors that are not parameters of the model")
    groups = []
    for s in slots:
        if id(s.param) not in where:
            if s.param.requires_grad:
                raise InvalidArgument(
                    f"parameter {s.name} is not in any of the optimizer's parameter groups but "
                    "requires grad; add it to the optimizer, or freeze it (requires_grad=False)")
            groups.append(-1)  # frozen: never changes
            continue
        groups.append(where[id(s.param)])
    return kind, groups


def _hook_optimizer(optimizer, after):
    """Runs after() right after every optimizer.step() (before any scheduler changes lr)."""
    if hasattr(optimizer, "register_step_post_hook"):
        optimizer.register_step_post_hook(lambda opt, args, kwargs: after())
        return
    original = optimizer.step

    def step(self, *args, **kwargs):
        out = original(*args, **kwargs)
        after()
        return out

    # A bound method, as torch's LR schedulers expect of optimizer.step.
    optimizer.step = types.MethodType(step, optimizer)


def _check_served(params: Mapping[str, object], shapes: Mapping[str, tuple], who: str,
                  place: str, serve_as: str, packed=None) -> list:
    """A serving engine worker's parameters against dte's serving layout for its rank, both ways,
    before anything is written: every tensor of the layout is a contiguous BF16 CPU parameter
    of its shape, and every parameter is in the layout (one dte would never update is refused).
    packed(name, p): whether the engine emptied that parameter and computes from a copy (then
    not checked; returned). who: the caller, as errors name it; place: the worker's rank;
    serve_as: how to serve BF16 unquantized with that engine."""
    torch = _torch()
    emptied = []
    for name, shape in shapes.items():
        p = params.get(name)
        if p is None:
            raise InvalidArgument(
                f"{who}: the served model has no parameter {name} ({place}); its parameters are "
                f"{sorted(params)[:6]} ...: is it the model of the config given?")
        if p.device.type != "cpu":
            raise UnsupportedError(
                f"{who}: {name} lives on {p.device}; this release applies publications into CPU "
                "tensors. GPU workers need the binding's CUDA receiver, which is not there yet")
        if packed is not None and packed(name, p):
            emptied.append(name)
            continue
        if tuple(p.shape) != tuple(shape) or p.dtype != torch.bfloat16 or not p.is_contiguous():
            raise UnsupportedError(
                f"{who}: {name} is {p.dtype} {tuple(p.shape)} in the served model; dte writes "
                f"contiguous BF16 {tuple(shape)} (serve with {serve_as}, unquantized)")
    unknown = sorted(set(params) - set(shapes))
    if unknown:
        raise InvalidArgument(
            f"{who}: the served model has parameters the config's layout does not ({place}): "
            f"{unknown[:4]}{' ...' if len(unknown) > 4 else ''}; dte would never update them: is "
            "the config the served model's?")
    return emptied


class TorchReceiver:
    """An inference worker's BF16 tensors, written in place by apply(message).

    tensors: name -> torch.bfloat16 CPU tensor (contiguous). Without infer, the HF tensors of
    the whole model (e.g. served.named_parameters()); the config may be given, or it is learnt
    from the first (full) publication. With infer='tp=N' and rank=r, the tensors of SGLang TP
    rank r (fused qkv_proj / gate_up_proj, vocabulary-padded embeddings; names and shapes from
    dte.TorchReceiver.shard_tensors(config, infer, rank)); config is then required.
    With quantization='fp8-block' (docs/fp8.md), the tensors of TP rank r of an engine that
    serves online FP8 (default infer tp=1), by the engine's names: each quantized linear weight
    ('...qkv_proj.weight', o_proj, gate_up_proj, down_proj) as torch.float8_e4m3fn [out, in]
    with its block scales '...weight_scale_inv' (torch.float32), and the tensors that stay BF16
    (embeddings, lm_head, norms, biases) as torch.bfloat16 (TorchReceiver.allocate() makes
    them). It applies the publications of a TorchPublisher(..., quantization=..., infer=...)
    for the same TP size; after each, every code and scale is the engine's own quantization of
    the trainer's BF16 weights, which the receiver checks against the sender's digest.
    A refused message raises a dte.Error subclass and changes nothing.
    """

    def __init__(self, tensors: Mapping[str, object], config=None, infer=None, rank: int = 0,
                 quantization: Optional[str] = None):
        self._tensors = dict(tensors)
        self._quantization = None if quantization is None else str(quantization)
        self._topology = _infer(infer)
        if self._quantization is not None and self._topology is None:
            self._topology = (1, 1)
        self._rank = rank
        self._native = None
        self._config = None
        if config is not None or self._topology is not None:
            self._bind(_config_text(config))

    @staticmethod
    def shard_tensors(config, infer, rank: int = 0, quantization: Optional[str] = None) -> Dict[str, tuple]:
        """The names and shapes of SGLang / vLLM TP rank `rank`'s tensors (BF16; with
        quantization, see allocate() for each one's dtype)."""
        return {name: shape for name, (shape, _) in
                TorchReceiver._layout(config, infer, rank, quantization).items()}

    @staticmethod
    def allocate(config, infer=None, rank: int = 0, quantization: Optional[str] = None) -> dict:
        """Zero-filled CPU tensors for TP rank `rank`, by name, in the dtypes the receiver takes."""
        torch = _torch()
        return {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in
                TorchReceiver._layout(config, infer, rank, quantization).items()}

    @staticmethod
    def _layout(config, infer, rank, quantization) -> Dict[str, tuple]:
        topology = _infer(infer) or (1, 1)
        tp, ep = topology
        if not 0 <= rank < tp:
            raise InvalidArgument(f"rank {rank} is not a rank of tp={tp}")
        config = _config_text(config)
        if quantization is None:
            return {name: (tuple(shape), _dtype("bf16")) for name, shape in _native.shard_info(config, tp, ep)}
        return {name: (tuple(shape), _dtype(kind))
                for name, shape, kind in _native.fp8_info(config, tp, ep, str(quantization))}

    def _bind(self, config: str):
        torch = _torch()
        if self._quantization is not None:
            self._bind_fp8(config)
            return
        if self._topology is None:
            info = _native.model_info(config)
            ordered = _match_parameters(self._tensors, info, "TorchReceiver")
            names = info["names"]
        else:
            tp, ep = self._topology
            shards = _native.shard_info(config, tp, ep)
            names = [n for n, _ in shards]
            ordered = _match_parameters(
                self._tensors, {"names": names, "shapes": [s for _, s in shards],
                                "structure": f"SGLang tp={tp} rank {self._rank}"}, "TorchReceiver")
        for n, t in zip(names, ordered):
            if t.dtype != torch.bfloat16:
                raise InvalidArgument(f"TorchReceiver: tensor {n} is {t.dtype}; receivers hold torch.bfloat16")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise InvalidArgument(f"TorchReceiver: tensor {n} must be a contiguous CPU tensor")
        self._ordered = ordered
        self._names = names
        self._ptrs = [t.data_ptr() for t in ordered]
        numel = [t.numel() for t in ordered]
        if self._topology is None:
            self._native = _native.HfReceiver(config, self._ptrs, numel)
        else:
            tp, ep = self._topology
            self._native = _native.ShardReceiver(config, tp, ep, self._rank, self._ptrs, numel)
        self._config = config

    def _bind_fp8(self, config: str):
        tp, ep = self._topology
        info = _native.fp8_info(config, tp, ep, self._quantization)
        names = [n for n, _, _ in info]
        ordered = _match_parameters(
            self._tensors, {"names": names, "shapes": [s for _, s, _ in info],
                            "structure": f"FP8 ({self._quantization}) tp={tp} rank {self._rank}"},
            "TorchReceiver")
        for (n, _, kind), t in zip(info, ordered):
            if t.dtype != _dtype(kind):
                raise InvalidArgument(f"TorchReceiver: tensor {n} is {t.dtype}; this FP8 receiver holds it as {_dtype(kind)}")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise InvalidArgument(f"TorchReceiver: tensor {n} must be a contiguous CPU tensor")
        lists = {"bf16": ([], []), "fp8": ([], []), "f32": ([], [])}
        for (_, _, kind), t in zip(info, ordered):
            lists[kind][0].append(t.data_ptr())
            lists[kind][1].append(t.numel())
        self._ordered = ordered
        self._ptrs = [t.data_ptr() for t in ordered]
        # report["touched"] holds serving-layout ids: their names
        self._names = [n for n, _ in _native.shard_info(config, tp, ep)]
        self._native = _native.Fp8Receiver(config, tp, ep, self._rank, self._quantization,
                                           *lists["bf16"], *lists["fp8"], *lists["f32"])
        self._config = config

    @property
    def version(self) -> Optional[int]:
        """The version held (None: nothing yet)."""
        return None if self._native is None else self._native.version

    @property
    def config(self) -> Optional[str]:
        return self._config

    def digest(self) -> tuple:
        """Per HF tensor, the digest of what these tensors hold (a TP rank: its part); empty
        until a publication is held."""
        if self._native is None or self._native.version is None:
            return ()
        return tuple(self._native.digest())

    def verify(self) -> bool:
        """Whether every tensor still holds exactly what dte wrote (recomputed from every
        element; HF receivers). A publication only notices changes to the elements it writes."""
        if self._native is None or not isinstance(self._native, (_native.HfReceiver, _native.Fp8Receiver)):
            raise InvalidArgument("verify() is for HF and FP8 receivers that hold a publication")
        return self._native.verify() == ""

    def apply(self, message: bytes) -> dict:
        """Applies one publication; raises a dte.Error subclass on refusal (nothing written).
        Returns what it did: version, base (None: full), full, changed (elements written),
        touched (the names of the tensors written), bytes, seconds, outcome ('committed', or
        'current' for a re-delivery of the version held)."""
        if not isinstance(message, (bytes, bytearray)):
            raise InvalidArgument(f"apply() takes the bytes a publisher returned, not {type(message).__name__}")
        if self._native is None:
            self._bind(_native.message_config(bytes(message)))
        for t, ptr in zip(self._ordered, self._ptrs):
            if t.data_ptr() != ptr:
                raise InvalidArgument("a receiver tensor was re-allocated since the TorchReceiver was made; make a new one")
        report = self._native.apply(bytes(message) if isinstance(message, bytearray) else message)
        report["touched"] = [self._names[t] for t in report["touched"]]
        return report


def _dtype(kind: str):
    torch = _torch()
    if kind == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise UnsupportedError(f"FP8 receivers need torch.float8_e4m3fn (torch >= 2.1); this torch is {torch.__version__}")
        return torch.float8_e4m3fn
    return {"bf16": torch.bfloat16, "f32": torch.float32}[kind]


def replica_matches(receivers, digest: Sequence[int], config=None, infer=None) -> bool:
    """Whether the TP ranks of one replica together hold exactly the trainer's state
    (pub.digest()). receivers: the TorchReceivers of every TP rank, in one process; or, with
    config and infer, each rank's rx.digest() gathered from the processes they run in, in rank
    order."""
    if config is not None or infer is not None:
        tp, ep = _infer(infer)
        return _native.check_replica_digests(_config_text(config), tp, ep,
                                             [list(d) for d in receivers], list(digest)) == ""
    ranks = [r._native for r in receivers]
    if any(not isinstance(r, _native.ShardReceiver) for r in ranks):
        raise InvalidArgument("replica_matches takes the TorchReceivers of every TP rank of one replica")
    return _native.check_replica(ranks, list(digest)) == ""


class StorageWriter:
    """Writes each publication as the next version of a shared-storage root (docs/storage.md):
    deltas as chunk files, full publications as anchors (Hugging Face checkpoint directories),
    then LATEST; retention removes what no reader can need. One writer per root."""

    def __init__(self, path, config):
        self._native = _native.StorageWriter(os.fspath(path), _config_text(config))

    def write(self, message: bytes) -> dict:
        return self._native.write(message)


class StorageReader:
    """Keeps a TorchReceiver current from a storage root: poll() applies every version from the
    one it holds to LATEST (from the newest anchor when it has fallen off the chain). name:
    registers the version held, so retention keeps what this reader needs."""

    def __init__(self, path, receiver: TorchReceiver, name: str = ""):
        if receiver.config is None:
            raise InvalidArgument("StorageReader: give the TorchReceiver its config (config=...)")
        self._rx = receiver
        self._source = _native.StorageSource(os.fspath(path), receiver.config, name)

    def poll(self, reports: Optional[list] = None) -> dict:
        """Applies every version after the one held, up to LATEST. reports: a list that receives
        each apply's report as it commits (kept when a later version is refused)."""
        before = self._rx.version
        applied = []
        for msg in self._source.since(before):
            report = self._rx.apply(msg)
            if reports is not None:
                reports.append(report)
            applied.append(report["version"])
            self._source.reached(self._rx.version)
        return {"from": before, "to": self._rx.version, "applied": applied}
