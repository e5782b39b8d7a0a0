"""`edgerun doctor`: what edgerun will use on this machine, and why."""

from __future__ import annotations

import llama_cpp

from edgerun import settings
from edgerun.errors import EdgerunError
from edgerun.models import catalog, fetch
from edgerun.models.gguf_check import inspect
from edgerun.runner import placement_for
from edgerun.runtime import devices


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(model: str) -> str:
    lines = [f"llama-cpp-python {llama_cpp.__version__}"]
    gpu = devices.gpu_offload_supported()
    lines.append(f"backend: {'CUDA (GPU offload)' if gpu else 'CPU only'}")
    lines.append(f"CPU features used: {devices.cpu_features()}")
    lines.append(f"threads: {settings.physical_cores()} (physical cores)")
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
    engine = settings.EngineSettings()
    plan = placement_for(info, engine)
    lines.append(
        f"offload plan for {model} at ctx {engine.n_ctx}: {plan.gpu_layers if plan.gpu_layers <= plan.total_layers else plan.total_layers}"
        f"/{plan.total_layers} layers on GPU ({_gib(plan.gpu_bytes)}), {_gib(plan.cpu_bytes)} on CPU; {plan.reason}"
    )
    return "\n".join(lines)
