# SPDX-License-Identifier: Apache-2.0
"""The vLLM worker side: dte's weight-transfer backend, registered as "dte" (dte.vllm.register).

vLLM builds one DteWeightTransferEngine per worker after loading the model
(weight_transfer_config={"backend": "dte"}). init_weight_transfer_engine binds a dte receiver to
the worker's own parameters: its TP rank's part of dte's serving layout, which is vLLM's (fused
qkv_proj and gate_up_proj, the vocabulary padded to 64 and split by rows). update_weights applies
one publication ({"publication": bytes}) or a storage root's chain to LATEST ({"storage": root})
in place, transactionally: a refusal raises before anything is written.

vLLM's CPU platform computes linear layers (and lm_head) from packed copies made at load time
(dispatch_cpu_unquantized_gemm), and empties the linear parameters. This engine keeps the BF16
weights live as the parameters (the receiver's tensors) and, after each commit, re-packs only the
layers the publication wrote, through vLLM's own dispatch: the engine computes exactly as a fresh
engine loaded with those weights. docs/vllm.md has the figures (memory: one more BF16 copy of the
linear weights; time: the re-pack of the touched layers).
"""
from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import dte


@dataclass
class DteInitInfo(WeightTransferInitInfo):
    """init_weight_transfer_engine's info; every field is optional (vLLM's own config decides).

    config: the model's config (a dict, a path to config.json or its directory, a dte preset);
    default: the served model's config.json. tp, rank: the inference topology and this worker's
    TP rank; default: vLLM's parallel config and its TP group. reader: the name this worker
    registers with a storage root (retention keeps what it needs); default "vllm-tp<rank>"."""

    config: Any = None
    tp: Optional[int] = None
    rank: Optional[int] = None
    reader: Optional[str] = None


@dataclass
class DteUpdateInfo(WeightTransferUpdateInfo):
    """update_weights' info: exactly one of
    publication: one dte publication (bytes; or its base64 text, for JSON over HTTP);
    storage: a storage root (docs/storage.md); every worker applies the chain from the version it
    holds to the root's LATEST.
    A malformed info is not raised here but refused by receive_weights, like a refused
    publication (DteWeightTransferEngine._raises says why)."""

    publication: Any = None
    storage: Optional[str] = None
    problem: Optional[str] = None

    def __post_init__(self) -> None:
        if self.problem is not None:
            return
        if (self.publication is None) == (self.storage is None):
            self.problem = ("give exactly one of {'publication': <bytes>} and "
                            "{'storage': '<root>'}")
            return
        p = self.publication
        if p is None:
            return
        if isinstance(p, str):
            try:
                self.publication = base64.b64decode(p, validate=True)
            except ValueError as e:
                self.problem = f"publication text is not base64 ({e})"
        elif isinstance(p, (bytearray, memoryview)):
            self.publication = bytes(p)
        elif not isinstance(p, bytes):
            self.problem = f"publication must be bytes (or base64 text), not {type(p).__name__}"


def _served_config(model_config) -> Any:
    """The served model's config as dte reads it: its config.json where the model is a local
    directory, else the config vLLM loaded."""
    path = getattr(model_config, "model", None)
    if isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json")):
        return path
    return model_config.hf_config.to_dict()


def _named(e: "dte.Error") -> "dte.Error":
    """e with its class named in the text (dte.FormatError: ...), so that the caller's
    dte.vllm.update raises the same class where vLLM carries only the message across
    processes."""
    return type(e)(f"dte.{type(e).__name__}: {e}")


def _live_parameter(module: torch.nn.Module, data: torch.Tensor) -> torch.nn.Parameter:
    """A linear layer's weight as vLLM's UnquantizedLinearMethod.create_weights makes it (the
    parameter class and loader attributes), holding `data`: vLLM's own loaders
    (load_weights, load_checkpoint_weight_patches) still work on a layer dte keeps live."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
    from vllm.model_executor.parameter import ModelWeightParameter
    from vllm.model_executor.utils import set_weight_attrs

    method = type(getattr(module, "quant_method", None)).__name__
    if method in WEIGHT_LOADER_V2_SUPPORTED and hasattr(module, "weight_loader_v2"):
        return ModelWeightParameter(data=data, input_dim=1, output_dim=0,
                                    weight_loader=module.weight_loader_v2)
    p = torch.nn.Parameter(data, requires_grad=False)
    attrs = {"input_dim": 1, "output_dim": 0}
    if hasattr(module, "weight_loader"):
        attrs["weight_loader"] = module.weight_loader
    set_weight_attrs(p, attrs)
    return p


class DteWeightTransferEngine(WeightTransferEngine[DteInitInfo, DteUpdateInfo]):
    init_info_cls = DteInitInfo
    update_info_cls = DteUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: Optional[dte.TorchReceiver] = None
        self.rank = 0
        self._packed: Dict[str, torch.nn.Module] = {}  # tensor -> a layer computing from a packed copy
        self._readers: Dict[str, dte.StorageReader] = {}
        self._reader_name = ""
        self.last: Optional[dict] = None
        self.live_bytes = 0  # the linear weights kept live beside vLLM's packed copies (CPU)

    # -- init --
    def init_transfer_engine(self, init_info: DteInitInfo) -> None:
        try:
            self._init(init_info)
        except dte.Error as e:
            # recorded by every worker, raised by one (_raises), as a refused update is
            refused = _named(e)
            self.receiver = None
            self.last = {"rank": self.rank, "version": None, "refused": str(refused)}
            if self._raises:
                raise refused from None

    def _init(self, init_info: DteInitInfo) -> None:
        if self.parallel_config.pipeline_parallel_size != 1:
            raise dte.UnsupportedError(
                "dte's vLLM backend keeps tensor-parallel workers in sync; pipeline_parallel_size "
                f"is {self.parallel_config.pipeline_parallel_size} (use 1)")
        from vllm.distributed import get_tensor_model_parallel_rank

        tp = init_info.tp or self.parallel_config.tensor_parallel_size
        rank = init_info.rank if init_info.rank is not None else get_tensor_model_parallel_rank()
        self.rank = rank
        config = init_info.config if init_info.config is not None else _served_config(self.model_config)
        if isinstance(config, str) and os.path.isdir(config):
            config = os.path.join(config, "config.json")
        shapes = dte.TorchReceiver.shard_tensors(config, f"tp={tp}", rank)
        params = dict(self.model.named_parameters())
        modules = {name: self.model.get_submodule(name.rpartition(".")[0]) for name in shapes}
        # Every parameter checked before any is touched; vLLM's CPU platform packs the linear
        # layers and empties their parameters.
        emptied = dte._check_served(
            params, shapes, "dte vLLM backend", f"TP rank {rank} of tp={tp}", "dtype='bfloat16'",
            packed=lambda name, p: (p.numel() == 0 and hasattr(modules[name], "cpu_linear")
                                    and p.dtype == torch.bfloat16))
        # dte's tensor becomes each emptied parameter again; the packed copy serves until a
        # publication writes that layer.
        live_bytes = 0
        for name in emptied:
            module = modules[name]
            module.weight = _live_parameter(module, torch.zeros(shapes[name], dtype=torch.bfloat16))
            live_bytes += module.weight.numel() * module.weight.element_size()
        params = dict(self.model.named_parameters())
        tensors = {name: params[name].data for name in shapes}
        packed = {name: m for name, m in modules.items() if hasattr(m, "cpu_linear")}
        self.receiver = dte.TorchReceiver(tensors, config=config, infer=f"tp={tp}", rank=rank)
        self._packed = packed
        self.live_bytes = live_bytes
        self._readers = {}
        self._reader_name = init_info.reader if init_info.reader is not None else f"vllm-tp{rank}"
        self.last = None

    # -- lifecycle: publications apply in place, so start and finish have nothing to do --
    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def parse_update_info(self, update_dict: dict) -> DteUpdateInfo:
        try:
            return DteUpdateInfo(**update_dict)
        except TypeError:
            return DteUpdateInfo(problem=f"unknown fields {sorted(set(update_dict) - {'publication', 'storage'})}"
                                 " (give 'publication' or 'storage')")

    def receive_weights(self, update_info: DteUpdateInfo) -> None:
        t0 = time.perf_counter()
        reports: List[dict] = []
        refused: Optional[dte.Error] = None
        try:
            if self.receiver is None:
                raise dte.ProtocolError(
                    "dte vLLM backend: call init_weight_transfer_engine before update_weights")
            if update_info.problem is not None:
                raise dte.InvalidArgument(f"dte update_info: {update_info.problem}")
            if update_info.publication is not None:
                reports.append(self.receiver.apply(update_info.publication))
            else:
                reader = self._readers.get(update_info.storage)
                if reader is None:
                    reader = dte.StorageReader(update_info.storage, self.receiver, name=self._reader_name)
                    self._readers[update_info.storage] = reader
                reader.poll(reports)
        except dte.Error as e:
            refused = _named(e)
        finally:
            # Whatever committed (a storage chain may stop at a refused version) reaches the
            # computation before this returns or raises.
            t1 = time.perf_counter()
            repacked = self._repack(reports)
            t2 = time.perf_counter()
            self.last = {
                "rank": self.rank,
                "version": None if self.receiver is None else self.receiver.version,
                "applied": [r["version"] for r in reports if r["outcome"] == "committed"],
                "full": any(r["full"] for r in reports),
                "changed": sum(r["changed"] for r in reports),
                "bytes": sum(r["bytes"] for r in reports),
                "seconds": t2 - t0,
                "apply_seconds": t1 - t0,
                "repack_seconds": t2 - t1,
                "repacked": repacked,
                "refused": None if refused is None else str(refused),
            }
        if refused is not None and self._raises:
            raise refused from None

    @property
    def _raises(self) -> bool:
        """Whether this worker raises a refusal (every worker records it in its report).

        Only the last worker of the engine's group raises: vLLM 0.32's MultiprocExecutor reads
        the workers' replies in rank order and stops at the first failure, leaving the other
        workers' replies queued, where the next collective_rpc would read them as its own (every
        later call then gets the reply to the one before). The last worker's failure is read
        after every other reply. dte.vllm.update checks every worker's report."""
        from vllm.distributed import get_world_group

        group = get_world_group()
        return group.rank_in_group == group.world_size - 1

    def _repack(self, reports: List[dict]) -> int:
        """Re-packs, from the tensors dte holds, every packed layer a committed publication wrote
        (the others' packed copies still hold what their tensors hold)."""
        touched = set()
        for r in reports:
            if r["outcome"] == "committed":
                touched.update(n for n in r["touched"] if n in self._packed)
        if not touched:
            return 0  # (GPU platforms pack nothing: the kernels read the parameters dte wrote)
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for name in sorted(touched):
            # vLLM's own dispatch, keeping the parameter (dte's tensor) live
            dispatch_cpu_unquantized_gemm(self._packed[name], remove_weight=False)
        return len(touched)

    def __call__(self, what: str = "report"):
        """Reached through collective_rpc("weight_transfer_engine", args=(what,)) (dte.vllm.reports):
        'report': what the last update did on this worker; 'digest': per HF tensor, the digest
        of this worker's part (dte.replica_matches(..., config=, infer=)); 'memory': the bytes of
        the weights kept live beside vLLM's packed copies, and the packed layers re-packed."""
        if what == "report":
            return self.last
        if what == "memory":
            return {"live_bytes": self.live_bytes, "packed_layers": len(self._packed)}
        if what == "digest":
            return list(self.receiver.digest()) if self.receiver is not None else []
        raise ValueError(f"dte vLLM backend: unknown query {what!r} ('report' or 'digest')")

    def shutdown(self) -> None:
        self._readers = {}
