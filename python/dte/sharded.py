# SPDX-License-Identifier: Apache-2.0
"""Where each HF tensor's elements live on this trainer rank (docs/python.md, "Sharded trainers").

A trainer rank holds local tensors (slots): the optimizer's parameters as this rank sees them,
each holding pieces of one HF tensor (consecutive canonical elements). How a slot maps to its
HF tensor depends on how the trainer shards:

    plain tensor         the whole tensor (one process, or DDP: every rank holds a replica and
                         only the group's rank 0 sends)
    DTensor (FSDP2, TP)  the block at the DTensor's global offset per dimension: one piece when
                         it holds whole rows (Shard(0)), one per row when it holds a column
                         block (Shard(1)); a replica on a Replicate mesh dimension sends only
                         from coordinate 0
    FSDP1                use_orig_params=True: each original parameter's part of the local flat
                         shard, at its intra-parameter start (flat_param._shard_param_infos)
    ZeRO                 ZeroRedundancyOptimizer: whole parameters, sent by their owner
                         (_param_to_rank); the others are replicas

Nothing here copies a tensor: the publisher reads each slot where it lives, every step.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Mapping, Optional, Sequence

from ._native import InvalidArgument, UnsupportedError

# Module wrappers' components in parameter names (DDP, FSDP1, torch.compile, activation
# checkpointing): dropped, so that names are the HF names of the config.
_WRAPPERS = ("module", "_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")


def hf_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


class Slot:
    """One local tensor: its parameter (the optimizer's key), HF tensor, and pieces
    (index in the HF tensor, length, offset in the local tensor, sender)."""

    __slots__ = ("name", "tensor", "param", "numel", "pieces", "_local")

    def __init__(self, name, tensor, param, local, pieces):
        self.name = name
        self.tensor = tensor
        self.param = param
        self._local = local
        self.numel = local(param).numel()
        self.pieces = pieces

    def local(self):
        """The local FP32 tensor as it is now (FSDP1 re-creates its views every step)."""
        return self._local(self.param)


def _torch():
    import torch

    return torch


# The sharding modules are looked up only where the trainer has loaded them already (a model
# with DTensors has imported torch.distributed.tensor): importing them can fail on old torch
# builds (Debian's torch 1.13 on Python 3.11), which a single-process trainer never needs.
def _loaded(module: str, name: str):
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _dtensor_type():
    return _loaded("torch.distributed.tensor", "DTensor")


def local_of(x):
    """The local part of a tensor (a DTensor's to_local(); a plain tensor itself)."""
    dt = _dtensor_type()
    if dt is not None and isinstance(x, dt):
        return x.to_local()
    return x


def _dtensor_pieces(name: str, p, shape: Sequence[int]):
    """A DTensor parameter's pieces: (index, length, offset) and whether this rank sends them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = p.device_mesh
    for pl in p.placements:
        if type(pl) not in (Shard, Replicate):  # (_StridedShard is a Shard subclass)
            raise UnsupportedError(
                f"parameter {name}: placement {pl!r} (FSDP2 over a tensor-parallel dimension "
                "gives strided shards); dte reads Shard(d) and Replicate placements")
    coord = mesh.get_coordinate()
    if coord is None:
        return [], False  # this rank is not in the parameter's mesh
    sender = all(c == 0 for c, pl in zip(coord, p.placements) if isinstance(pl, Replicate))
    local_shape, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, p.placements)
    local_shape = tuple(int(x) for x in local_shape)
    offset = tuple(int(x) for x in offset)
    if tuple(p.to_local().shape) != local_shape:
        raise InvalidArgument(
            f"parameter {name}: the local shard has shape {tuple(p.to_local().shape)}, its DTensor "
            f"placements {p.placements} say {local_shape}")
    n = 1
    for d in local_shape:
        n *= d
    if n == 0:
        return [], sender
    if len(shape) == 1:
        return [(offset[0], local_shape[0], 0)], sender
    if len(shape) != 2:
        raise UnsupportedError(f"parameter {name}: {len(shape)}-D; dte maps 1-D and 2-D HF tensors")
    rows, cols = shape
    lr, lc = local_shape
    r0, c0 = offset
    if lc == cols:  # whole rows: one piece
        return [(r0 * cols, lr * cols, 0)], sender
    return [((r0 + r) * cols + c0, lc, r * lc) for r in range(lr)], sender


def _fsdp1_infos(model) -> Dict[int, object]:
    """FSDP1 (use_orig_params=True): per original parameter object, its _ShardParamInfo."""
    fsdp = _loaded("torch.distributed.fsdp", "FullyShardedDataParallel")
    if fsdp is None or not any(isinstance(m, fsdp) for m in model.modules()):
        return {}
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    out = {}
    for handle in _get_fsdp_handles(model):
        flat = handle.flat_param
        params = getattr(flat, "_params", None)
        if params is None:
            raise UnsupportedError(
                "FSDP1 without use_orig_params=True: the optimizer steps flat parameters that mix "
                "tensors; wrap with FullyShardedDataParallel(..., use_orig_params=True)")
        for q, info in zip(params, flat._shard_param_infos):
            out[id(q)] = info
    return out


def check_names(named: Mapping[str, object], names: Sequence[str], what: str):
    """Refuses `named` unless its names are exactly `names`, naming the first few either way."""
    known = set(names)
    missing = [n for n in names if n not in named]
    extra = [n for n in named if n not in known]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if extra:
            parts.append(f"not in the model's config {extra[:4]}{' ...' if len(extra) > 4 else ''}")
        raise InvalidArgument(f"{what}: " + "; ".join(parts) + ". dte maps tensors by their HF names")


def named_tensors(model):
    """(name, tensor) of a module's parameters, or of a mapping name -> tensor (a trainer's own
    FP32 master weights beside a BF16 module)."""
    if isinstance(model, Mapping):
        return list(model.items())
    return list(model.named_parameters())


def slots(model, names: Sequence[str], shapes: Sequence[Sequence[int]], rank: int,
          owner=None) -> List[Slot]:
    """This rank's slots, one per parameter that holds elements here, in the model's order.

    owner: param -> group rank (ZeroRedundancyOptimizer's _param_to_rank), or None."""
    index = {n: t for t, n in enumerate(names)}
    named: Dict[str, object] = {}
    for raw, p in named_tensors(model):
        n = hf_name(raw)
        if n in named:
            raise InvalidArgument(f"two parameters are named {n} once wrapper prefixes are dropped ({raw})")
        named[n] = p
    check_names(named, names, "TorchPublisher: the model's parameters do not match its config")
    fsdp1 = _fsdp1_infos(model)
    dt = _dtensor_type()
    out: List[Slot] = []
    for name in names:
        t = index[name]
        p = named[name]
        shape = list(shapes[t])
        numel = 1
        for d in shape:
            numel *= d
        if dt is not None and isinstance(p, dt):
            if list(p.shape) != shape:
                raise InvalidArgument(f"TorchPublisher: tensor {name} has shape {tuple(p.shape)}, the model's config says {tuple(shape)}")
            pieces, sender = _dtensor_pieces(name, p, shape)
            if pieces:
                out.append(Slot(name, t, p, local_of, [(i, n, o, sender) for i, n, o in pieces]))
            continue
        if id(p) in fsdp1:
            info = fsdp1[id(p)]
            if not info.in_shard or not info.numel_in_shard:
                continue
            if p.numel() != info.numel_in_shard:
                raise InvalidArgument(
                    f"parameter {name}: FSDP1 holds {info.numel_in_shard} of its elements here, the "
                    f"parameter has {p.numel()} (call the publisher outside forward and backward)")
            out.append(Slot(name, t, p, lambda q: q, [(info.intra_param_start_idx, info.numel_in_shard, 0, True)]))
            continue
        if list(p.shape) != shape:
            raise InvalidArgument(f"TorchPublisher: tensor {name} has shape {tuple(p.shape)}, the model's config says {tuple(shape)}")
        if owner is not None and p in owner:
            if owner[p] != rank:
                continue  # another rank owns and sends it
            sender = True
        else:
            sender = rank == 0  # a replica on every rank (one process; DDP; frozen under ZeRO)
        out.append(Slot(name, t, p, lambda q: q, [(0, numel, 0, sender)]))
    return out


def device_of(slots: Sequence[Slot], cuda_built: bool):
    """Where this rank's tensors live, one device for all: the CPU, or one CUDA device (the
    device path: the native side detects there and brings only the changes to the host)."""
    torch = _torch()
    first = {}
    for s in slots:
        device = s.local().device
        if device.type not in ("cpu", "cuda"):
            raise UnsupportedError(
                f"parameter of {s.name} is on {device}: dte reads CPU and CUDA tensors")
        first.setdefault(device, s.name)
    if not first:
        return torch.device("cpu")
    if len(first) > 1:
        (d0, n0), (d1, n1) = list(first.items())[:2]
        raise InvalidArgument(
            f"TorchPublisher: parameter of {n0} is on {d0} and parameter of {n1} on {d1}: a "
            "publisher reads the tensors of one device (one trainer process per GPU)")
    ((device, name),) = first.items()
    if device.type == "cpu":
        return device
    if not cuda_built:
        raise UnsupportedError(
            f"parameter of {name} is on {device}: this dte._native was built without CUDA (nvcc "
            "was not found when the package was built); install it again with nvcc on PATH")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


def check_local(slot: Slot, x, what: str, device):
    """A slot's tensor (weights or state) as the native side reads it: FP32, contiguous, its
    size, on the publisher's device."""
    torch = _torch()
    if x.device != device:
        raise InvalidArgument(
            f"{what} of {slot.name} is on {x.device} where the publisher reads {device} (the "
            "weights and the optimizer state of one rank on one device)")
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != slot.numel:
        raise InvalidArgument(
            f"{what} of {slot.name} is {x.dtype} {tuple(x.shape)}{'' if x.is_contiguous() else ' (strided)'}: "
            f"dte reads contiguous FP32 tensors of the local shard's {slot.numel} elements (keep the "
            "master weights and the optimizer state in torch.float32)")


def zero_owner(optimizer) -> Optional[dict]:
    """ZeroRedundancyOptimizer's parameter owners (group ranks), or None."""
    zero = _loaded("torch.distributed.optim", "ZeroRedundancyOptimizer")
    if zero is not None and isinstance(optimizer, zero):
        return optimizer._param_to_rank
    return None


def inner_optimizer(optimizer):
    """The optimizer that steps this rank's parameters (ZeRO's local one)."""
    zero = _loaded("torch.distributed.optim", "ZeroRedundancyOptimizer")
    if zero is not None and isinstance(optimizer, zero):
        return optimizer.optim
    return optimizer
