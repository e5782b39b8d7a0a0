"""What hardware is here: CPU features llama.cpp uses, GPU backend, free memory."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import llama_cpp
import psutil


@dataclass(frozen=True)
class Gpu:
    name: str
    total: int
    free: int


@dataclass(frozen=True)
class Memory:
    """Free memory the placement plan works with."""

    free_ram: int
    free_vram: int
    gpu: bool


def memory() -> Memory:
    return Memory(free_ram=free_ram(), free_vram=free_vram(), gpu=gpu_offload_supported())


def cpu_features() -> str:
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    cpu = next((part for part in info.split("|") if "CPU" in part), "")
    flags = [p.split("=")[0].strip().removeprefix("CPU :").strip() for p in info.split("|") if "= 1" in p]
    return " ".join(f for f in flags if f) or cpu.strip()


def gpu_offload_supported() -> bool:
    """A local GPU backend is here. llama.cpp's own llama_supports_gpu_offload is also true for a
    CPU build with the RPC backend (remote devices), so ask ggml for a local GPU device."""
    from edgerun.runtime import rpc

    return bool(llama_cpp.llama_supports_gpu_offload()) and bool(rpc.local_gpus())


def gpus() -> list[Gpu]:
    """NVIDIA GPUs with their free memory, from nvidia-smi (empty when there is none)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        name, total, free = (x.strip() for x in line.split(","))
        found.append(Gpu(name, int(total) << 20, int(free) << 20))
    return found


def free_vram() -> int:
    return sum(g.free for g in gpus()) if gpu_offload_supported() else 0


def free_ram() -> int:
    return psutil.virtual_memory().available
