# SPDX-License-Identifier: Apache-2.0
"""The vLLM worker side: dte's weight-transfer backend, registered as "dte" (dte.vllm.register).

vLLM builds one DteWeightTransferEngine per worker after loading the model
(weight_transfer_config={"backend": "dte"}). init_weight_transfer_engine binds a dte receiver to
the worker's own parameters: its TP rank's part of dte's serving layout, which is vLLM's (fused
qkv_proj and gate_up_proj, the vocabulary padded to 64 and split by rows). update_weights applies
one publication ({"publication": bytes}) or a storage root's chain to LATEST ({"storage": root})
in place, transactionally: a refusal raises before anything is written.

vLLM's CPU platform computes linear layers (and lm_head, tied or not) from copies made at load
time (dispatch_cpu_unquantized_gemm packs the weights and empties the linear parameters; AMX
kernels take small layers' biases in FP32). This engine keeps the BF16 weights live as the
receiver's tensors and, after each commit, refreshes every copy whose source the publication
wrote, found from the modules themselves (a tied lm_head is re-packed when the embedding is
written), through vLLM's own dispatch: the engine computes exactly as a fresh engine loaded
with those weights. docs/vllm.md has the story and the figures.
"""
from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

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


def _derived_copies(model: torch.nn.Module, tensors: Dict[str, torch.Tensor],
                    shadows: Dict[str, torch.Tensor],
                    params: Dict[str, torch.Tensor]) -> Dict[str, List[Callable[[], None]]]:
    """Per tensor dte writes, how to refresh every copy of it that the engine computes with:
    found from the modules themselves, not from the names dte writes. On vLLM's CPU platform a
    module with `cpu_linear` computes from a copy of its weight packed at load; the source is
    the weight's storage, so a tied lm_head (its weight is embed_tokens') is re-packed when the
    embedding is written. A packed module whose weight is no tensor dte writes would serve a
    stale copy: refused. An FP32 bias (shadows) is copied from dte's BF16 tensor."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    by_storage = {t.untyped_storage().data_ptr(): name for name, t in tensors.items()}
    refresh: Dict[str, List[Callable[[], None]]] = {name: [] for name in tensors}
    seen = set()
    for mname, m in model.named_modules(remove_duplicate=False):
        if id(m) in seen or not hasattr(m, "cpu_linear"):
            continue
        seen.add(id(m))
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.is_meta:
            continue
        source = by_storage.get(w.untyped_storage().data_ptr()) if w.numel() else None
        if source is None:
            raise dte.UnsupportedError(
                f"dte vLLM backend: {mname or 'the model'} computes from a packed copy of a "
                f"weight dte does not write ({type(m).__name__}, weight {tuple(w.shape)}); it "
                "would keep serving the weights it was loaded with")
        # vLLM's own dispatch, keeping the parameter (dte's tensor) live
        refresh[source].append(lambda m=m: dispatch_cpu_unquantized_gemm(m, remove_weight=False))
    for name, shadow in shadows.items():
        refresh[name].append(lambda dst=params[name].data, src=shadow: dst.copy_(src))
    return refresh


class DteWeightTransferEngine(WeightTransferEngine[DteInitInfo, DteUpdateInfo]):
    init_info_cls = DteInitInfo
    update_info_cls = DteUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: Optional[dte.TorchReceiver] = None
        self.rank = 0
        # dte's tensor -> how to bring every copy the engine computes with from it up to date
        self._refresh: Dict[str, List[Callable[[], None]]] = {}
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
            self.last = {"rank": self.rank, "version": None, "outcome": "refused",
                         "refused": str(refused)}
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
        engine_config = _served_config(self.model_config)
        config = init_info.config if init_info.config is not None else engine_config
        if isinstance(config, str) and os.path.isdir(config):
            config = os.path.join(config, "config.json")
        # The config the receiver is bound to must make the model the engine computes with
        # (vLLM's hf_config, overrides included): the same structure and forward fields.
        differs = dte._native.config_difference(
            dte._config_text(config), dte._config_text(self.model_config.hf_config.to_dict()),
            "the config given to dte", "the engine's config")
        if differs:
            raise dte.InvalidArgument(
                f"dte vLLM backend: the config given to dte and the model vLLM serves differ in "
                f"{differs}; give init the served model's config (or serve the trainer's)")
        shapes = dte.TorchReceiver.shard_tensors(config, f"tp={tp}", rank)
        params = dict(self.model.named_parameters())
        modules = {name: self.model.get_submodule(name.rpartition(".")[0]) for name in shapes}

        def served_from_copy(name, p):
            """Whether vLLM's CPU platform serves parameter `name` from a copy it made at load:
            'emptied' (a linear weight packed, the parameter emptied) or 'fp32' (a bias its
            AMX kernels take as FP32, converted in place)."""
            if not hasattr(modules[name], "cpu_linear"):
                return None
            if name.endswith(".weight") and p.numel() == 0 and p.dtype == torch.bfloat16:
                return "emptied"
            if (name.endswith(".bias") and p.dtype == torch.float32
                    and tuple(p.shape) == tuple(shapes[name]) and p.is_contiguous()):
                return "fp32"
            return None

        # Every parameter checked before any is touched.
        copied = dte._check_served(
            params, shapes, "dte vLLM backend", f"TP rank {rank} of tp={tp}", "dtype='bfloat16'",
            packed=lambda name, p: served_from_copy(name, p) is not None)
        # dte's tensor becomes each emptied parameter again; the packed copy serves until a
        # publication writes that layer. An FP32 bias gets a BF16 tensor for dte to write, copied
        # into the bias after each commit that writes it (exactly: BF16 values are FP32 values).
        live_bytes = 0
        shadows: Dict[str, torch.Tensor] = {}
        for name in copied:
            module = modules[name]
            if served_from_copy(name, params[name]) == "emptied":
                module.weight = _live_parameter(module, torch.zeros(shapes[name], dtype=torch.bfloat16))
                live_bytes += module.weight.numel() * module.weight.element_size()
            else:
                bias = params[name].data
                shadow = bias.to(torch.bfloat16)
                if not torch.equal(shadow.float(), bias):
                    raise dte.UnsupportedError(
                        f"dte vLLM backend: {name} holds FP32 values that are not BF16 ones "
                        f"(TP rank {rank}); dte writes BF16 (serve with dtype='bfloat16')")
                shadows[name] = shadow
                live_bytes += shadow.numel() * shadow.element_size()
        params = dict(self.model.named_parameters())
        tensors = {name: shadows.get(name, params[name].data) for name in shapes}
        self._refresh = _derived_copies(self.model, tensors, shadows, params)
        self.receiver = dte.TorchReceiver(tensors, config=config, infer=f"tp={tp}", rank=rank)
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
            committed = [r for r in reports if r["outcome"] == "committed"]
            self.last = {
                "rank": self.rank,
                # as a receiver's: 'refused', 'committed' (something new applied), or 'current'
                # (a re-delivery of the version held, or a storage root with nothing new)
                "outcome": ("refused" if refused is not None else
                            "committed" if committed else "current"),
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
        """Brings up to date, from the tensors dte holds, every copy the engine computes with
        whose source a committed publication wrote (packed layers, FP32 biases); the others
        still hold what their sources hold. Returns how many copies it refreshed."""
        touched = set()
        for r in reports:
            if r["outcome"] == "committed":
                touched.update(r["touched"])
        done = 0
        for name in sorted(touched):
            for refresh in self._refresh.get(name, ()):
                refresh()
                done += 1
        return done  # (GPU platforms keep no copies: the kernels read the parameters dte wrote)

    def __call__(self, what: str = "report"):
        """Reached through collective_rpc("weight_transfer_engine", args=(what,)) (dte.vllm.reports):
        'report': what the last update did on this worker; 'digest': per HF tensor, the digest
        of this worker's part (dte.replica_matches(..., config=, infer=)); 'memory': the bytes of
        the weights kept live beside vLLM's packed copies, and the packed layers re-packed."""
        if what == "report":
            return self.last
        if what == "memory":
            return {"live_bytes": self.live_bytes,
                    "packed_layers": sum(len(v) for v in self._refresh.values())}
        if what == "version":
            return None if self.receiver is None else self.receiver.version
        if what == "digest":
            return list(self.receiver.digest()) if self.receiver is not None else []
        raise ValueError(f"dte vLLM backend: unknown query {what!r} ('report', 'digest', "
                         "'memory' or 'version')")

    def shutdown(self) -> None:
        self._readers = {}
