# SPDX-License-Identifier: Apache-2.0
"""dte.sglang: SGLang kept in sync by dte publications, through SGLang's custom weight loader.

SGLang side: start the server (or sglang.Engine) with `--custom-weight-loader dte.sglang.load`
(Engine: custom_weight_loader=["dte.sglang.load"]); nothing else to import there.

    msg = pub.step()                               # a dte.TorchPublisher in the trainer
    dte.sglang.update(engine, publication=msg)     # begin -> update_weights_from_tensor -> end
    dte.sglang.update(engine, storage=root)        # or: every worker follows a storage root
    dte.sglang.update_server(url, publication=msg) # the same over the server's HTTP routes

Every TP/EP worker applies its own rank's part of the publication in place into the model's
parameters, transactionally, through the same receiver as the vLLM backend. A refusal changes
nothing; the worker records it (it never raises into SGLang: an exception in a loader ends
SGLang's scheduler process), and update() raises it from the workers' reports.
docs/sglang.md has the whole story.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import tempfile
import time
import urllib.request
import weakref
from typing import Any, Dict, List, Optional

import dte

LOADER = "dte.sglang.load"
PUBLICATION = "dte.publication"  # the message's bytes, as a torch.uint8 tensor
STORAGE = "dte.storage"          # a storage root's path (UTF-8), as a torch.uint8 tensor
REPORTS = "dte.reports"          # where each worker writes its report: {"dir", "token"} (JSON)
STATUS = "dte.status"            # no update: each worker only reports (dte.sglang.version)

__all__ = ["LOADER", "PUBLICATION", "STORAGE", "REPORTS", "STATUS", "load", "report", "payload",
           "for_engine", "update", "update_server", "read_reports", "version"]

_log = logging.getLogger("dte.sglang")


# ---------------------------------------------------------------- the worker side

class _Worker:
    """One model's dte receiver and where it stands (one per SGLang worker process)."""

    def __init__(self) -> None:
        self.receiver: Optional[dte.TorchReceiver] = None
        self.rank = 0
        self.tp = 1
        self.ep = 1
        self.readers: Dict[str, dte.StorageReader] = {}
        self.last: Optional[dict] = None


_workers: "weakref.WeakKeyDictionary[Any, _Worker]" = weakref.WeakKeyDictionary()


def _text(t, what: str) -> str:
    try:
        return _bytes(t, what).decode("utf-8")
    except UnicodeDecodeError:
        raise dte.InvalidArgument(f"dte.sglang.load: {what} is not UTF-8 text") from None


def _bytes(t, what: str) -> bytes:
    import torch

    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise dte.InvalidArgument(
            f"dte.sglang.load: {what} must be a 1-D torch.uint8 tensor (dte.sglang.payload makes "
            f"it), not {getattr(t, 'dtype', type(t).__name__)}")
    # (SGLang moves every payload tensor to the worker's device; the receiver reads host bytes)
    return t.detach().cpu().numpy().tobytes()


def _parallel() -> dict:
    """This worker's place, from SGLang's own parallel state."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    out = {}
    for key in ("tp_rank", "tp_size", "pp_size", "attn_tp_size", "moe_ep_size", "moe_ep_rank",
                "moe_tp_size", "moe_tp_rank"):
        out[key] = int(getattr(p, key))
    return out


def _served_config(model) -> str:
    config = getattr(model, "config", None)
    if config is None:
        raise dte.InvalidArgument("dte.sglang.load: the model has no .config (its HF config)")
    return dte._config_text(config)


def _bind(worker: _Worker, model) -> None:
    """Binds a receiver to this worker's parameters: every one checked against dte's serving
    layout for its rank, both ways, before anything is written (dte._check_served)."""
    par = _parallel()
    tp, rank = par["tp_size"], par["tp_rank"]
    worker.rank, worker.tp = rank, tp
    if par["pp_size"] != 1:
        raise dte.UnsupportedError(
            f"dte.sglang: pipeline parallel size is {par['pp_size']}; dte keeps tensor- and "
            "expert-parallel workers in sync (serve with --pp-size 1)")
    if par["attn_tp_size"] != tp:
        raise dte.UnsupportedError(
            f"dte.sglang: the attention TP size is {par['attn_tp_size']} of tp={tp} (DP attention "
            "or context parallelism); dte writes the layout of plain TP attention")
    config = _served_config(model)
    shapes = dte.TorchReceiver.shard_tensors(config, f"tp={tp}", rank)
    moe = any(".experts." in n for n in shapes)
    ep = par["moe_ep_size"] if moe else 1
    worker.ep = ep
    if moe:
        shapes = dte.TorchReceiver.shard_tensors(config, f"tp={tp},ep={ep}", rank)
        moe_tp = tp // ep
        if (par["moe_tp_size"], par["moe_ep_rank"], par["moe_tp_rank"]) != (moe_tp, rank // moe_tp, rank % moe_tp):
            raise dte.UnsupportedError(
                f"dte.sglang: TP rank {rank} of tp={tp}, ep={ep} is MoE EP rank {par['moe_ep_rank']}, "
                f"MoE TP rank {par['moe_tp_rank']} of {par['moe_tp_size']} in this SGLang; dte's layout "
                f"has EP rank {rank // moe_tp}, MoE TP rank {rank % moe_tp} of {moe_tp} (moe_dp_size 1)")
    params = dict(model.named_parameters())
    dte._check_served(params, shapes, "dte.sglang", f"TP rank {rank} of tp={tp}", "--dtype bfloat16")
    for mname, module in model.named_modules():
        # Layouts other than the one dte writes, or copies the kernels compute from instead of
        # the parameters: refused rather than written and never served.
        for flag, why in (("use_intel_amx_backend", "packs the weights for AMX kernels"),
                          ("use_triton_kernels", "transposes the experts (triton_kernels backend)"),
                          ("use_flashinfer_trtllm_moe", "swaps and shuffles the experts"),
                          ("enable_flashinfer_cutlass_moe", "stores up before gate"),
                          ("use_deep_gemm", "keeps the experts in DeepGEMM's layout")):
            if getattr(module, flag, False) is True:
                raise dte.UnsupportedError(
                    f"dte.sglang: {mname or 'the model'} has {flag}: SGLang {why}; dte writes the "
                    "parameters in the default layout (docs/sglang.md, the backends it refuses)")
        if getattr(module, "num_fused_shared_experts", 0):
            raise dte.UnsupportedError(
                f"dte.sglang: {mname} fuses shared experts into its expert tensor; not supported")
    tensors = {name: params[name].data for name in shapes}
    worker.receiver = dte.TorchReceiver(tensors, config=config, infer=f"tp={tp},ep={ep}", rank=rank)
    worker.readers = {}


def _write_report(where: dict, rank: int, report: dict) -> None:
    directory = where["dir"]
    report = dict(report, token=where["token"])
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"tp{rank}.json")
    fd, tmp = tempfile.mkstemp(prefix=f".tp{rank}.", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(tmp, final)


def _named(e: "dte.Error") -> str:
    return f"dte.{type(e).__name__}: {e}"


def load(model, named_tensors) -> None:
    """SGLang's custom weight loader (`--custom-weight-loader dte.sglang.load`), called by every
    TP worker as load(model, named_tensors) within update_weights_from_tensor(...,
    load_format="dte.sglang.load"). named_tensors (dte.sglang.payload makes them): exactly one
    of ("dte.publication", message bytes) and ("dte.storage", a root), and optionally
    ("dte.reports", a directory for this worker's report), each a torch.uint8 tensor.

    The worker applies its rank's part in place. It never raises a dte refusal into SGLang (an
    exception in a loader ends SGLang's scheduler process and leaves the other TP workers
    waiting): it logs it, keeps every parameter as it was, and records it in its report."""
    t0 = time.perf_counter()
    worker = _workers.get(model)
    if worker is None:
        worker = _Worker()
        _workers[model] = worker
    reports: List[dict] = []
    refused: Optional[str] = None
    where = None
    try:
        items = list(named_tensors)
        names = [n for n, _ in items]
        where = next((_where(_text(t, REPORTS)) for n, t in items if n == REPORTS), None)
        given = [n for n in names if n in (PUBLICATION, STORAGE, STATUS)]
        unknown = sorted(set(names) - {PUBLICATION, STORAGE, STATUS, REPORTS})
        if unknown or len(given) != 1 or len(names) != len(set(names)):
            raise dte.InvalidArgument(
                f"dte.sglang.load: got tensors {names}; give exactly one of {PUBLICATION!r}, "
                f"{STORAGE!r} and {STATUS!r}, and optionally {REPORTS!r} (dte.sglang.payload "
                "makes them)")
        value = dict(items)[given[0]]
        if worker.receiver is None:
            _bind(worker, model)
        if given[0] == STATUS:
            pass  # (the report below says what this worker holds)
        elif given[0] == PUBLICATION:
            reports.append(worker.receiver.apply(_bytes(value, PUBLICATION)))
        else:
            root = _text(value, STORAGE)
            if not os.path.isdir(root):
                # (a reader of a root yet to be written would wait silently: a mistyped path,
                # or one this host does not mount, would keep the old weights without a word)
                raise dte.InvalidArgument(
                    f"dte.sglang.load: storage root {root!r} is not a directory on this worker's "
                    "host; give the path under which the workers see the trainer's root")
            reader = worker.readers.get(root)
            if reader is None:
                reader = dte.StorageReader(root, worker.receiver, name=f"sglang-tp{worker.rank}")
                worker.readers[root] = reader
            reader.poll(reports)
    except dte.Error as e:
        refused = _named(e)
    except Exception as e:  # noqa: BLE001 -- not raised into SGLang either (see above)
        refused = f"dte.Error: unexpected {type(e).__name__} in dte.sglang.load: {e}"
    if refused is not None:
        held = None if worker.receiver is None else worker.receiver.version
        _log.error("%s (TP rank %d; it holds version %s)", refused, worker.rank, held)
    committed = [r for r in reports if r["outcome"] == "committed"]
    worker.last = {
        "rank": worker.rank,
        "tp": worker.tp,
        # as a receiver's: 'refused', 'committed' (something new applied), or 'current' (a
        # re-delivery of the version held, nothing new in a storage root, or a status query)
        "outcome": "refused" if refused is not None else "committed" if committed else "current",
        "version": None if worker.receiver is None else worker.receiver.version,
        "applied": [r["version"] for r in reports if r["outcome"] == "committed"],
        "full": any(r["full"] for r in reports),
        "changed": sum(r["changed"] for r in reports),
        "bytes": sum(r["bytes"] for r in reports),
        "seconds": time.perf_counter() - t0,
        "refused": refused,
    }
    if where is not None:
        try:
            _write_report(where, worker.rank, worker.last)
        except OSError as e:
            _log.error("dte.sglang.load: cannot write the report to %s: %s", where["dir"], e)


def _where(text: str) -> dict:
    try:
        where = json.loads(text)
        if isinstance(where, dict) and isinstance(where.get("dir"), str) and isinstance(where.get("token"), str):
            return where
    except ValueError:
        pass
    raise dte.InvalidArgument(f"dte.sglang.load: {REPORTS!r} is not {{\"dir\", \"token\"}} JSON")


def report(model) -> Optional[dict]:
    """What the last load() on this model did (in the worker's process): rank, tp, outcome
    ('committed', 'current', 'refused'), version, applied, full, changed, bytes, seconds,
    refused (None, or the dte error's text)."""
    worker = _workers.get(model)
    return None if worker is None else worker.last


# ---------------------------------------------------------------- the trainer side

def payload(publication: Optional[bytes] = None, storage=None, reports=None,
            token: str = "", status: bool = False) -> list:
    """The named tensors of one update: [("dte.publication", uint8 tensor)] or
    [("dte.storage", ...)] (or, with status=True, [("dte.status", ...)]: no update, each worker
    only reports), plus ("dte.reports", ...) when reports (a directory) is given: each worker
    then writes its report there as tp<rank>.json, carrying `token`."""
    import torch

    def as_tensor(b: bytes):
        return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)

    if status:
        if publication is not None or storage is not None:
            raise dte.InvalidArgument("dte.sglang: a status query carries no publication or storage")
        items = [(STATUS, as_tensor(b""))]
    elif (publication is None) == (storage is None):
        raise dte.InvalidArgument("dte.sglang: give exactly one of publication= (bytes) and storage= (a root)")
    elif publication is not None:
        if not isinstance(publication, (bytes, bytearray)):
            raise TypeError(f"publication must be the bytes a TorchPublisher returned, not {type(publication).__name__}")
        items = [(PUBLICATION, as_tensor(bytes(publication)))]
    else:
        items = [(STORAGE, as_tensor(os.fspath(storage).encode("utf-8")))]
    if reports is not None:
        where = {"dir": os.fspath(reports), "token": str(token)}
        items.append((REPORTS, as_tensor(json.dumps(where).encode("utf-8"))))
    return items


def for_engine(items: list, tp: int) -> list:
    """payload()'s items as sglang.Engine.update_weights_from_tensor should carry them: each
    value a LocalSerializedTensor holding, per TP rank, the tensor pickled as plain bytes.

    The Engine pickles its list with torch's ForkingPickler, which shares a CPU tensor's memory
    through a file descriptor (same host only) and, in a process where SGLang's
    monkey_patch_torch_reductions has run (its weight-sync utilities, or a worker in this
    process), fails on CPU tensors altogether. Plain bytes cross either way."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

    return [(name, LocalSerializedTensor(values=[pickle.dumps(t)] * tp)) for name, t in items]


def read_reports(directory, tp: int, token: str) -> List[Optional[dict]]:
    """The reports the TP workers wrote in `directory` for the update that carried `token`
    (None for a worker that wrote none for it)."""
    out: List[Optional[dict]] = []
    for rank in range(tp):
        path = os.path.join(os.fspath(directory), f"tp{rank}.json")
        try:
            with open(path, encoding="utf-8") as f:
                rep = json.load(f)
        except (OSError, ValueError):
            rep = None
        out.append(rep if isinstance(rep, dict) and rep.get("token") == token else None)
    return out


def _token() -> str:
    return base64.b32encode(os.urandom(10)).decode("ascii")


def _checked(reports: List[Optional[dict]], where: str) -> List[dict]:
    missing = [r for r, rep in enumerate(reports) if rep is None]
    if missing:
        raise dte.ProtocolError(
            f"dte.sglang: TP workers {missing} wrote no report to {where}: is the server started with "
            f"--custom-weight-loader {LOADER}, and the directory theirs to write?")
    for rep in reports:
        if rep["refused"]:
            raise dte._error_from_text(rep["refused"], f"TP worker {rep['rank']} refused: ")
    return reports


def update(engine, publication: Optional[bytes] = None, storage=None, reports=None,
           flush_cache: bool = True, status: bool = False) -> List[dict]:
    """One publication (or a storage root's chain) into an sglang.Engine started with
    custom_weight_loader=["dte.sglang.load"]: begin_weight_update -> update_weights_from_tensor
    -> end_weight_update. Returns the TP workers' reports; a refusal raises the worker's dte
    error (dte.FormatError, ProtocolError, ...). reports: the directory the workers write
    their reports to (default: a temporary one; the workers share this host)."""
    own = reports is None
    directory = tempfile.mkdtemp(prefix="dte-sglang-") if own else os.fspath(reports)
    try:
        token = _token()
        tp = int(engine.server_args.tp_size)
        items = for_engine(payload(publication, storage, directory, token, status), tp)
        begun = engine.begin_weight_update()
        if isinstance(begun, tuple) and not begun[0]:
            raise dte.ProtocolError(f"dte.sglang: SGLang refused to begin a weight update: {begun[1]}")
        try:
            result = engine.update_weights_from_tensor(items, load_format=LOADER, flush_cache=flush_cache)
        finally:
            engine.end_weight_update()
        reps = _checked(read_reports(directory, tp, token), directory)
        if isinstance(result, tuple) and not result[0]:
            raise dte.ProtocolError(f"dte.sglang: SGLang's update_weights_from_tensor failed: {result[1]}")
        return reps
    finally:
        if own:
            for name in os.listdir(directory):
                os.unlink(os.path.join(directory, name))
            os.rmdir(directory)


def _post(url: str, route: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url.rstrip("/") + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}") | {"success": False}


def update_server(url: str, publication: Optional[bytes] = None, storage=None, reports=None,
                  tp: Optional[int] = None, flush_cache: bool = True, timeout: float = 600.0,
                  status: bool = False):
    """The same over a server's HTTP routes (/begin_weight_update, /update_weights_from_tensor,
    /end_weight_update). The named tensors travel as plain pickled bytes (base64), which SGLang's
    safe unpickler accepts, so the trainer need not share the server's host. tp: the server's
    TP size (default: asked from /get_server_info). reports: a directory both sides reach
    (shared storage); without it, refusals are in the workers' logs only and this returns None."""
    if tp is None:
        with urllib.request.urlopen(url.rstrip("/") + "/get_server_info", timeout=timeout) as r:
            tp = int(json.loads(r.read())["tp_size"])
    token = _token()
    items = payload(publication, storage, reports, token, status)
    blob = base64.b64encode(pickle.dumps(items)).decode("ascii")
    begun = _post(url, "/begin_weight_update", {}, timeout)
    if not begun.get("success", False):
        raise dte.ProtocolError(f"dte.sglang: {url} refused to begin a weight update: {begun.get('message')}")
    try:
        result = _post(url, "/update_weights_from_tensor",
                       {"serialized_named_tensors": [blob] * tp, "load_format": LOADER,
                        "flush_cache": flush_cache}, timeout)
    finally:
        _post(url, "/end_weight_update", {}, timeout)
    reps = None if reports is None else _checked(read_reports(reports, tp, token), os.fspath(reports))
    if not result.get("success", False):
        raise dte.ProtocolError(f"dte.sglang: {url} update_weights_from_tensor failed: {result.get('message')}")
    return reps


def version(engine, reports=None, timeout: float = 600.0) -> Optional[int]:
    """The version every TP worker holds (None: nothing yet): an sglang.Engine, or a server's
    URL (then reports: a directory the server's workers and this process both reach; default a
    temporary one, for a server on this host). It asks through the loader without updating
    (a "dte.status" payload). What a restarted trainer gives TorchPublisher(...,
    continue_after=...). Raises dte.ProtocolError when the workers disagree."""
    if isinstance(engine, str):
        own = reports is None
        directory = tempfile.mkdtemp(prefix="dte-sglang-") if own else os.fspath(reports)
        try:
            reps = update_server(engine, reports=directory, status=True, flush_cache=False,
                                 timeout=timeout)
        finally:
            if own:
                for name in os.listdir(directory):
                    os.unlink(os.path.join(directory, name))
                os.rmdir(directory)
    else:
        reps = update(engine, reports=reports, status=True, flush_cache=False)
    held = sorted({r["version"] for r in reps}, key=lambda v: -1 if v is None else v)
    if len(held) != 1:
        raise dte.ProtocolError(
            f"dte.sglang.version: the TP workers hold different versions {held}; send a full "
            "publication (pub.publish_full())")
    return held[0]
