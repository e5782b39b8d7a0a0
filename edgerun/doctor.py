"""`edgerun doctor`: what edgerun will use on this machine, and why."""

from __future__ import annotations

import llama_cpp

from edgerun import settings
from edgerun.errors import EdgerunError
from edgerun.models import catalog, fetch
from edgerun.models.gguf_check import inspect
from edgerun.runner import placement_for, remote_devices
from edgerun.runtime import devices, placement, rpc


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _rate(bytes_per_s: float | None) -> str:
    return f"{bytes_per_s / 1e9:.1f} GB/s" if bytes_per_s else "? (not measured)"


def report(model: str, rpc_spec: str = "") -> str:
    """rpc_spec: `--rpc`'s servers, connected and planned with (a server down is an error)."""
    lines = [f"llama-cpp-python {llama_cpp.__version__}"]
    gpu = devices.gpu_offload_supported()
    lines.append(f"backend: {'CUDA (GPU offload)' if gpu else 'CPU only'}")
    lines.append(f"RPC backend: {rpc.available()}")
    lines.append(f"CPU features used: {devices.cpu_features()}")
    lines.append(f"threads: {settings.default_threads()} "
                 f"({settings.THREADS_ENV if settings.threads_from_env() else 'physical cores'})")
    lines.append(f"free RAM: {_gib(devices.free_ram())}")
    cards = devices.gpus()
    for g in cards:
        lines.append(f"GPU: {g.name}, {_gib(g.free)} free of {_gib(g.total)}")
    if not cards:
        lines.append("GPU: none found")
    lines.append("models:")
    for e in catalog.load().entries:
        state = "verified" if fetch.is_verified(e) else ("present, unverified" if fetch.is_present(e) else "not pulled")
        lines.append(f"  {e.name:<22} {e.size / 1e9:5.2f} GB  {state}")
    try:
        info = inspect(fetch.resolve(model))
    except EdgerunError as exc:
        lines.append(f"offload plan for {model}: unavailable ({exc})")
        return "\n".join(lines)
    engine = settings.EngineSettings(rpc=rpc_spec)
    remote = remote_devices(engine)
    if remote:
        from edgerun.runtime import devspeed

        here = devspeed.local_cpu_bytes_per_s()
        lines.append(f"this CPU streams weights at {_rate(here)} (a quantized matrix-vector product, as a decode step)")
    for d in remote:
        slow = (" (not clearly faster than this CPU: it adds memory, not speed)"
                if d.speed and here and d.speed < here / placement.SPEED_CLASS else "")
        lines.append(f"rpc device {d.name} at {d.endpoint}: {_gib(d.free)} free of {_gib(d.total)},"
                     f" streams weights at {_rate(d.speed)}{slow}")
    draft_name = catalog.load().find(model).draft if catalog.load().find(model) else None
    draft_info = None
    if draft_name and gpu and fetch.is_present(catalog.load().get(draft_name)):
        draft_info = inspect(fetch.resolve(draft_name))
    try:
        plan = placement_for(info, engine, draft_info, remote=remote)
    except EdgerunError as exc:
        lines.append(f"offload plan for {model} at ctx {engine.n_ctx}: does not fit ({exc})")
        return "\n".join(lines)
    lines.append(f"offload plan for {model} at ctx {engine.n_ctx} ({plan.reason}):")
    where = plan.devices.describe() if plan.devices else plan.target.describe()
    lines.append(f"  target {info.name}: {where}")
    if plan.draft and draft_name:
        lines.append(f"  draft {draft_name}: {plan.draft.describe()}")
    return "\n".join(lines)
