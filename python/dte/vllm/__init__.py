# SPDX-License-Identifier: Apache-2.0
"""dte.vllm: vLLM kept in sync by dte publications, through vLLM's weight-transfer API.

vLLM side (nothing to import): installing dte registers the backend "dte" in every vLLM
process through the `vllm.general_plugins` entry point (dte.vllm:register).

    llm = LLM(model=DIR, dtype="bfloat16", weight_transfer_config={"backend": "dte"})
    dte.vllm.init(llm)                      # collective_rpc("init_weight_transfer_engine")
    msg = pub.step()                        # a dte.TorchPublisher in the trainer
    dte.vllm.update(llm, publication=msg)   # start -> update -> finish, then the prefix cache
    dte.vllm.update(llm, storage=root)      # or: every worker follows a storage root to LATEST

A server started with `vllm serve DIR --weight-transfer-config '{"backend": "dte"}'` (with
VLLM_SERVER_DEV_MODE=1 for its weight-update routes) is driven the same way by
dte.vllm.update_server(url, ...). docs/vllm.md has the whole story.
"""
from __future__ import annotations

import base64
import json
import urllib.request
from typing import List, Optional

BACKEND = "dte"

__all__ = ["BACKEND", "register", "init", "update", "reports", "version", "update_server",
           "server_reports"]


def register() -> None:
    """The vllm.general_plugins entry point: registers the backend "dte" (lazily: the engine
    module is imported only when a worker builds it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    _request_amx()

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "dte.vllm.engine", "DteWeightTransferEngine")
    except ValueError:
        pass  # registered already (plugins load once per process, but a user may call this too)


def _request_amx() -> None:
    """Where the CPU has AMX, asks Linux for the AMX tile state in this process
    (torch.cpu._init_amx: arch_prctl ARCH_REQ_XCOMP_PERM). vLLM 0.32's CPU platform picks its
    AMX attention kernels when the CPU has AMX, but a spawned worker process never asks for the
    tile state itself, so its first AMX instruction dies with SIGILL (seen on this project's CI machines,
    stock engine or not). The plugin runs in every vLLM process: the request is one system
    call, and nothing where the CPU has no AMX."""
    try:
        import torch

        if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
            torch.cpu._init_amx()
    except Exception:  # noqa: BLE001 -- never stop vLLM from starting over this
        pass


def _update_info(publication, storage) -> dict:
    if (publication is None) == (storage is None):
        raise ValueError("dte.vllm: give exactly one of publication= (bytes) and storage= (a root)")
    if publication is not None:
        if not isinstance(publication, (bytes, bytearray)):
            raise TypeError(f"publication must be the bytes a TorchPublisher returned, not {type(publication).__name__}")
        return {"publication": bytes(publication)}
    return {"storage": str(storage)}


def init(llm, **init_info) -> None:
    """Binds every worker's dte receiver to its parameters (once, after LLM(...)). init_info:
    config, tp, rank, reader (dte.vllm.engine.DteInitInfo); by default vLLM's own. A worker
    that refuses (parameters that are not the config's layout) raises its dte error here."""
    try:
        llm.init_weight_transfer_engine({"init_info": dict(init_info)})
        error = None
    except Exception as e:
        error = e
    _checked(reports(llm), error)


def reports(llm) -> List[Optional[dict]]:
    """Per worker, what its last update did: outcome ('committed', 'current' for a re-delivery
    of the version held or nothing new in a storage root, 'refused'), version, applied, full,
    changed, bytes, seconds (apply_seconds + repack_seconds), repacked, rank, refused."""
    # The worker's engine object answers (DteWeightTransferEngine.__call__): a method by name,
    # so it works across processes without pickled callables.
    return llm.collective_rpc("weight_transfer_engine", args=("report",))


def version(engine, timeout: float = 60.0) -> Optional[int]:
    """The version every worker of `engine` holds (None: nothing yet): an LLM, or a server's
    URL (its /collective_rpc route, VLLM_SERVER_DEV_MODE=1). What a restarted trainer gives
    TorchPublisher(..., continue_after=...). Raises dte.ProtocolError when the workers disagree
    (send a full publication)."""
    import dte

    if isinstance(engine, str):
        got = _post(engine, "/collective_rpc",
                    {"method": "weight_transfer_engine", "args": ["version"]}, timeout)
        held = got.get("results", [])
    else:
        held = engine.collective_rpc("weight_transfer_engine", args=("version",))
    if not held:
        raise dte.ProtocolError("dte.vllm.version: the engine answered no worker")
    if len(set(held)) != 1:
        raise dte.ProtocolError(
            f"dte.vllm.version: the workers hold different versions {held}; send a full "
            "publication (pub.publish_full())")
    return held[0]


def update(llm, publication: Optional[bytes] = None, storage=None) -> List[Optional[dict]]:
    """vLLM's start -> update -> finish for one publication (or a storage root's chain), then
    the prefix cache reset (its KV blocks were computed with the previous weights). Returns the
    workers' reports. A refusal raises the worker's dte error (dte.FormatError, ProtocolError,
    ...) with its reason; every worker keeps the version it held and its session is closed."""
    return _session(llm.start_weight_update, lambda info: llm.update_weights({"update_info": info}),
                    llm.finish_weight_update, llm.reset_prefix_cache, lambda: reports(llm),
                    _update_info(publication, storage))


def _session(start, update_weights, finish, reset_prefix_cache, get_reports, info):
    """The update sequence, for an LLM or a server: start, update, finish, the prefix cache
    reset, then every worker's report checked."""
    start()
    try:
        update_weights(info)
        error = None
    except Exception as e:
        error = e
    # After a refusal only one worker raised (the last: DteWeightTransferEngine._raises), which
    # ended its session; the others recorded it and still hold theirs open. finish ends them, and
    # raises on the worker whose session ended already (vLLM's own check): expected then.
    try:
        finish()
    except Exception:
        if error is None:
            raise
    reset_prefix_cache()
    return _checked(get_reports(), error)


def _checked(got: List[Optional[dict]], error: Optional[Exception]) -> List[Optional[dict]]:
    """The workers' reports, or the refusal they recorded raised as its dte class."""
    import dte

    refusals = [r["refused"] for r in got if r and r.get("refused")]
    versions = sorted({r["version"] for r in got if r}, key=lambda v: -1 if v is None else v)
    if (refusals or error is not None) and len(versions) > 1:
        raise dte.ProtocolError(
            f"dte.vllm: the workers hold different versions {versions} after a refused update "
            f"({refusals[0] if refusals else error}); send a full publication (pub.publish_full())")
    if refusals:
        raise dte._error_from_text(refusals[0])
    if error is not None:
        raise error
    return got


def _post(url: str, route: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url.rstrip("/") + route, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode() or "{}"
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        raise RuntimeError(f"dte.vllm: {route} answered {e.code}: {detail}") from None
    try:
        return json.loads(text)
    except ValueError:
        return {"text": text}


def update_server(url: str, publication: Optional[bytes] = None, storage=None,
                  init_info: Optional[dict] = None, timeout: float = 600.0) -> List[Optional[dict]]:
    """dte.vllm.update over a vLLM server's HTTP routes (`vllm serve` with
    VLLM_SERVER_DEV_MODE=1): /init_weight_transfer_engine (when init_info is given: once),
    /start_weight_update, /update_weights ({"publication": base64} or {"storage": root}),
    /finish_weight_update, /reset_prefix_cache, then the workers' reports through
    /collective_rpc. Returns them; a refusal raises as in update()."""
    info = _update_info(publication, storage)
    if "publication" in info:
        info["publication"] = base64.b64encode(info["publication"]).decode()
    if init_info is not None:
        _post(url, "/init_weight_transfer_engine", {"init_info": init_info}, timeout)
    return _session(lambda: _post(url, "/start_weight_update", {}, timeout),
                    lambda i: _post(url, "/update_weights", {"update_info": i}, timeout),
                    lambda: _post(url, "/finish_weight_update", {}, timeout),
                    lambda: _post(url, "/reset_prefix_cache", {}, timeout),
                    lambda: server_reports(url, timeout), info)


def server_reports(url: str, timeout: float = 60.0) -> List[Optional[dict]]:
    """reports() of a server (its /collective_rpc route)."""
    got = _post(url, "/collective_rpc", {"method": "weight_transfer_engine", "args": ["report"]},
                timeout)
    return got.get("results", [])
