"""Where the model's layers go: how many fit on the GPU. A pure function of sizes."""

from __future__ import annotations

from dataclasses import dataclass

MARGIN_BYTES = 512 << 20  # compute buffers, CUDA context and fragmentation


@dataclass(frozen=True)
class Plan:
    gpu_layers: int
    total_layers: int
    gpu_bytes: int
    cpu_bytes: int
    reason: str


def kv_bytes_per_layer(n_ctx: int, n_head_kv: int, head_dim: int, bytes_per_elem: int = 2) -> int:
    """K and V for one layer at full context (f16 cache by default)."""
    return 2 * n_ctx * n_head_kv * head_dim * bytes_per_elem


def plan(
    layer_bytes: tuple[int, ...],
    other_bytes: int,
    kv_per_layer: int,
    free_vram: int,
    *,
    gpu_available: bool,
    requested: str = "auto",
) -> Plan:
    """Choose n_gpu_layers. 'auto' puts as many whole layers (weights + their KV) on the GPU as fit
    in free VRAM minus a margin; the output head goes with the last layer (llama.cpp's rule)."""
    n = len(layer_bytes)
    total = sum(layer_bytes) + other_bytes + kv_per_layer * n
    if not gpu_available or requested == "0":
        why = "no GPU backend" if not gpu_available else "--gpu-layers 0"
        return Plan(0, n, 0, total, f"all on CPU ({why})")
    if requested != "auto":
        k = max(0, min(int(requested), n))
        gpu = sum(layer_bytes[n - k :]) + kv_per_layer * k
        return Plan(k, n, gpu, total - gpu, f"{k} layers on GPU as requested")
    budget = free_vram - MARGIN_BYTES - other_bytes  # embeddings/output head are offloaded with all layers
    k, used = 0, 0
    for size in reversed(layer_bytes):  # llama.cpp offloads the last layers first
        if used + size + kv_per_layer > budget:
            break
        used += size + kv_per_layer
        k += 1
    gpu = used + (other_bytes if k == n else 0)
    why = "fits entirely in VRAM" if k == n else f"{k}/{n} layers fit in {free_vram / 2**30:.1f} GiB free VRAM"
    return Plan(k if k < n else n + 1, n, gpu, total - gpu, why)
