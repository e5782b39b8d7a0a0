"""Where the models go: how many target layers fit on the GPU, the draft first. A pure function of
sizes: the GGUF's per-layer bytes, the KV cache at the chosen context, compute buffers, and free
VRAM and RAM."""

from __future__ import annotations

from dataclasses import dataclass

from edgerun.errors import ConfigError, DoesNotFit

GiB = 2**30
VRAM_MARGIN = 512 << 20  # CUDA context, cuBLAS workspace, fragmentation
RAM_MARGIN = 1 << 30  # the OS, Python, the UI


@dataclass(frozen=True)
class Footprint:
    """What one model needs, from its GGUF and the context settings."""

    layer_bytes: tuple[int, ...]  # weights of each repeating block
    input_bytes: int  # token embeddings: llama.cpp keeps them in host memory
    output_bytes: int  # output head + final norm: on the GPU only when every block is
    kv_per_layer: int  # K + V of one block at the chosen context
    compute_bytes: int  # scratch for one micro-batch (activations, attention scores, logits)
    tied_head: bool = False  # the head reuses the input embeddings (a GPU head needs its own copy)
    body_compute_bytes: int | None = None  # scratch of a device without the head (no logits); None: compute_bytes

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def body_compute(self) -> int:
        """Scratch of a device that holds blocks but not the head."""
        return self.compute_bytes if self.body_compute_bytes is None else self.body_compute_bytes

    @property
    def head_on_cpu(self) -> int:
        """The head's bytes when it stays in host memory (a tied head shares the embeddings)."""
        return self.output_bytes - (self.input_bytes if self.tied_head else 0)

    @property
    def total(self) -> int:
        """Everything, with the head in host memory."""
        return sum(self.layer_bytes) + self.input_bytes + self.head_on_cpu + self.kv_per_layer * self.n_layers


@dataclass(frozen=True)
class Split:
    """One model's placement: the n_gpu_layers to give llama.cpp and the bytes on each side."""

    gpu_layers: int  # llama.cpp's count: n_layers + 1 also offloads the output layer
    n_layers: int
    gpu_bytes: int
    cpu_bytes: int

    @property
    def blocks_on_gpu(self) -> int:
        return min(self.gpu_layers, self.n_layers)

    @property
    def all_on_gpu(self) -> bool:
        return self.gpu_layers > self.n_layers

    def describe(self) -> str:
        if self.gpu_layers == 0:
            return f"all on CPU ({self.cpu_bytes / GiB:.2f} GiB RAM)"
        where = "all on GPU" if self.all_on_gpu else f"{self.blocks_on_gpu}/{self.n_layers} layers on GPU"
        return f"{where} ({self.gpu_bytes / GiB:.2f} GiB VRAM, {self.cpu_bytes / GiB:.2f} GiB RAM)"


@dataclass(frozen=True)
class Plan:
    target: Split
    draft: Split | None
    reason: str
    devices: "DeviceSplit | None" = None  # the target over remote devices (--rpc), which then decides

    @property
    def gpu_bytes(self) -> int:
        return self.target.gpu_bytes + (self.draft.gpu_bytes if self.draft else 0)

    @property
    def cpu_bytes(self) -> int:
        return self.target.cpu_bytes + (self.draft.cpu_bytes if self.draft else 0)


def kv_bytes_per_layer(n_ctx: int, n_head_kv: int, head_dim: int, bytes_per_elem: int = 2) -> int:
    """K and V for one layer at full context (f16 cache by default)."""
    return 2 * n_ctx * n_head_kv * head_dim * bytes_per_elem


def compute_bytes(n_ubatch: int, n_vocab: int, n_embd: int, n_head: int, n_ctx: int, *, flash_attn: bool = True) -> int:
    """llama.cpp's compute buffer for one micro-batch (f32): the logits of every position in it plus
    the residual stream and its normed copy; without flash attention one layer's attention scores
    too. Measured on qwen2 and gemma3 models (tests/test_placement.py checks it against the size
    llama.cpp reports)."""
    scores = 0 if flash_attn else n_ctx * n_head
    return 4 * n_ubatch * (n_vocab + 2 * n_embd + scores)


def split(fp: Footprint, n: int) -> Split:
    """The bytes per side when llama.cpp offloads the last n blocks (n_layers + 1: the head too).
    Offloaded blocks keep their KV cache on the GPU; each side that computes has a compute buffer."""
    blocks = min(n, fp.n_layers)
    gpu = sum(fp.layer_bytes[fp.n_layers - blocks :]) + fp.kv_per_layer * blocks
    cpu = fp.total - gpu + fp.compute_bytes
    if n > fp.n_layers:
        gpu += fp.output_bytes
        cpu -= fp.head_on_cpu
    if n > 0:
        gpu += fp.compute_bytes
    return Split(n, fp.n_layers, gpu, cpu)


def _most_layers(fp: Footprint, budget: int) -> int:
    """The largest n whose GPU share fits the budget (GPU bytes grow with n)."""
    best = 0
    for n in range(1, fp.n_layers + 2):
        if split(fp, n).gpu_bytes > budget:
            break
        best = n
    return best


def plan(
    target: Footprint,
    draft: Footprint | None,
    *,
    free_vram: int,
    free_ram: int,
    gpu_available: bool,
    requested: str = "auto",
) -> Plan:
    """Choose n_gpu_layers for the target and the draft.

    auto: the draft goes entirely on the GPU first when it fits (its steps are the latency-critical
    part of a speculative round), then as many target blocks as fit in what is left, last blocks
    first (llama.cpp's order), the output head with the last one. A number is taken as asked.
    Refuses, before anything loads, a plan whose host share does not fit in free RAM, and a
    request that is neither auto nor a count (on a machine without a GPU too)."""
    if requested != "auto" and not requested.isdigit():
        raise ConfigError(f"--gpu-layers {requested!r} is not a number; use auto, 0 or a layer count")
    if not gpu_available:
        result = Plan(split(target, 0), split(draft, 0) if draft else None, "no GPU backend: all on CPU")
    elif requested == "auto":
        result = _auto(target, draft, free_vram - VRAM_MARGIN)
    else:
        n = min(int(requested), target.n_layers + 1)
        tsplit = split(target, n)
        dsplit, note = _draft_first(draft, free_vram - VRAM_MARGIN - tsplit.gpu_bytes)
        result = Plan(tsplit, dsplit, "; ".join(x for x in (f"{min(n, target.n_layers)} target layers on GPU as asked", note) if x))
    _check_ram(result, free_ram)
    return result


def draft_threads(draft: Split, n_threads: int) -> int:
    """CPU threads for the draft's context. All on the GPU, a draft step's CPU part is one row of
    token embeddings, and spreading that over every thread wakes them all each step: with the
    target on 16 CPU threads that cost replies 5–10% on an H200."""
    return 1 if draft.all_on_gpu else n_threads


def _draft_first(draft: Footprint | None, budget: int) -> tuple[Split | None, str]:
    if draft is None:
        return None, ""
    full = split(draft, draft.n_layers + 1)
    if full.gpu_bytes <= budget:
        return full, "draft fully on GPU"
    return split(draft, 0), "draft on CPU (does not fit in VRAM)"


def _auto(target: Footprint, draft: Footprint | None, budget: int) -> Plan:
    dsplit, note = _draft_first(draft, budget)
    if dsplit is not None:
        budget -= dsplit.gpu_bytes
    n = _most_layers(target, budget)
    if n > target.n_layers:
        head = "target fits entirely in VRAM"
    elif n == 0:
        head = "no target layer fits in VRAM"
    else:
        head = f"{n}/{target.n_layers} target layers fit in VRAM"
    return Plan(split(target, n), dsplit, "; ".join(x for x in (head, note) if x))


def _check_ram(p: Plan, free_ram: int) -> None:
    usable = free_ram - RAM_MARGIN
    if p.cpu_bytes <= usable:
        return
    raise DoesNotFit(
        f"the plan needs {p.cpu_bytes / GiB:.1f} GiB of RAM and {p.gpu_bytes / GiB:.1f} GiB of VRAM,"
        f" but only {max(usable, 0) / GiB:.1f} GiB of RAM is free (after a {RAM_MARGIN / GiB:.0f} GiB margin)"
    )


# Remote devices (--rpc): target blocks over several devices besides the local CPU.

@dataclass(frozen=True)
class Place:
    """A device that can hold target blocks besides the local CPU: a local GPU or a device an RPC
    server offers. `free` is what it reported; `speed` ranks it (higher is faster per block)."""

    name: str
    free: int
    speed: float = 1.0
    margin: int = VRAM_MARGIN  # what the device's own runtime keeps (CUDA context, fragmentation)


@dataclass(frozen=True)
class Share:
    name: str
    blocks: int
    bytes: int
    head: bool  # the output head (llama.cpp puts it on the last device that holds blocks)


@dataclass(frozen=True)
class DeviceSplit:
    """The target over several devices: llama.cpp's n_gpu_layers and tensor_split (one entry per
    device, in its order), and what each side holds."""

    shares: tuple[Share, ...]
    cpu_blocks: int
    cpu_bytes: int
    n_layers: int

    @property
    def gpu_layers(self) -> int:
        """llama.cpp offloads the output layer and n_gpu_layers - 1 blocks (the last ones)."""
        offloaded = sum(s.blocks for s in self.shares)
        return offloaded + 1 if offloaded else 0

    @property
    def tensor_split(self) -> tuple[float, ...]:
        """Positions per device: llama.cpp deals the offloaded blocks, then the head, out in
        device order by these proportions; whole counts give exact block counts."""
        return tuple(float(s.blocks + s.head) for s in self.shares)

    @property
    def device_bytes(self) -> int:
        return sum(s.bytes for s in self.shares)

    def describe(self) -> str:
        parts = [f"{self.cpu_blocks}/{self.n_layers} layers on the local CPU ({self.cpu_bytes / GiB:.2f} GiB RAM)"]
        parts += [f"{s.blocks} on {s.name}{' + head' if s.head else ''} ({s.bytes / GiB:.2f} GiB)"
                  for s in self.shares if s.blocks]
        return ", ".join(parts)


def plan_devices(fp: Footprint, places: list[Place], *, free_ram: int) -> DeviceSplit:
    """Target blocks over the places (in llama.cpp's device order) and the local CPU.

    Layers run one after another, so a reply is fastest with every block on the fastest device
    that has room: places are filled fastest first, places of equal speed in proportion to their
    free memory (as llama.cpp's own default split), and the local CPU takes the first blocks that
    fit nowhere else. The head goes with the last place that holds blocks, and room for it (and
    its logits' scratch) is kept there. Refuses a plan whose host share does not fit in free RAM."""
    # the head (and its logits' scratch) goes to the last place with blocks: try each place as that
    # one, last first, with no blocks after it; the first that gets blocks itself is the plan
    for head_on in range(len(places) - 1, -1, -1):
        blocks, left = _deal(fp, places, head_on)
        if blocks[head_on]:
            return _shares(fp, places, blocks, left, free_ram)
    return _shares(fp, places, [0] * len(places), fp.n_layers, free_ram)


def _deal(fp: Footprint, places: list[Place], head_on: int) -> tuple[list[int], int]:
    """Blocks per place (fastest first, equal speeds by free memory) and the blocks left for the CPU."""
    per_block = max(fp.layer_bytes, default=0) + fp.kv_per_layer
    body = fp.body_compute
    room = [0 if i > head_on else max(0, p.free - p.margin - (fp.compute_bytes + fp.output_bytes if i == head_on
                                                             else body)) // max(per_block, 1)
            for i, p in enumerate(places)]
    blocks = [0] * len(places)
    left = fp.n_layers
    for speed in sorted({p.speed for p in places}, reverse=True):
        group = [i for i, p in enumerate(places) if p.speed == speed and room[i] > 0]
        take = min(left, sum(room[i] for i in group))
        if not take:
            continue
        total_room = sum(room[i] for i in group)
        quota = {i: take * room[i] / total_room for i in group}  # largest remainders get what rounding left
        given = {i: int(quota[i]) for i in group}
        for i in sorted(group, key=lambda i: quota[i] - given[i], reverse=True) + group:
            if sum(given.values()) < take and given[i] < room[i]:
                given[i] += 1
        for i, n in given.items():
            blocks[i] = n
        left -= take
    return blocks, left


def _shares(fp: Footprint, places: list[Place], blocks: list[int], left: int, free_ram: int) -> DeviceSplit:
    last = max((i for i, n in enumerate(blocks) if n), default=-1)
    body = fp.body_compute
    shares = []
    start = left  # llama.cpp: the first blocks stay on the CPU, the rest go out in device order
    for i, p in enumerate(places):
        layer = sum(fp.layer_bytes[start:start + blocks[i]]) + fp.kv_per_layer * blocks[i]
        start += blocks[i]
        used = layer + (fp.compute_bytes + fp.output_bytes if i == last else body if blocks[i] else 0)
        shares.append(Share(p.name, blocks[i], used, i == last))
    cpu = (sum(fp.layer_bytes[:left]) + fp.kv_per_layer * left + fp.input_bytes
           + (fp.compute_bytes + fp.head_on_cpu if last < 0 else body))
    result = DeviceSplit(tuple(shares), left, cpu, fp.n_layers)
    usable = free_ram - RAM_MARGIN
    if cpu > usable:
        raise DoesNotFit(
            f"{left} of {fp.n_layers} layers fit on no device and need {cpu / GiB:.1f} GiB of RAM here, but only"
            f" {max(usable, 0) / GiB:.1f} GiB is free: add an rpc server, give the servers more --mem, or use a smaller --ctx")
    return result


LOCAL_GPU_SPEED = 4.0  # a local GPU ranks before remote devices: no network hop, and the head's logits stay here
SPEED_CLASS = 0.5  # remote devices within 2x of the fastest of their class rank as equally fast


def speed_classes(speeds: list[float | None]) -> list[float]:
    """Ranks for plan_devices from measured speeds (weight bytes per second; None: not measured),
    1.0 for the fastest class. A device at least SPEED_CLASS of its class's fastest shares its
    rank, so devices alike but measured with noise still share blocks in proportion to memory,
    while a remote CPU beside a remote GPU (ten times slower or more) gets blocks only when the
    GPU is full. An unmeasured device ranks with the fastest (as if nothing were known)."""
    known = sorted((s for s in speeds if s), reverse=True)
    if not known:
        return [1.0] * len(speeds)
    heads = []
    for s in known:
        if not heads or s < SPEED_CLASS * heads[-1]:
            heads.append(s)
    return [1.0 if not s else next(h for h in heads if s >= SPEED_CLASS * h) / known[0] for s in speeds]
REMOTE_MARGIN = 128 << 20  # a server reports free memory after its runtime started; fragmentation only


def plan_remote(target: Footprint, draft: Footprint | None, remote: list[Place], *, free_vram: int, free_ram: int,
                gpu_available: bool) -> Plan:
    """The plan with remote devices (--rpc): the draft stays local (its steps are latency-bound: a
    network round trip per draft token would lose), on the local GPU first when it fits; the
    target's blocks go over the remote devices and what the local GPU has left (listed last, so
    the head and its logits stay on this machine), the rest on the local CPU."""
    dsplit, note = _draft_first(draft, free_vram - VRAM_MARGIN) if gpu_available else (
        (split(draft, 0), "draft on CPU") if draft else (None, ""))
    places = list(remote)
    if gpu_available:
        left = free_vram - (dsplit.gpu_bytes if dsplit else 0)
        places.append(Place("local GPU", left, speed=LOCAL_GPU_SPEED))
    devs = plan_devices(target, places, free_ram=free_ram - (dsplit.cpu_bytes if dsplit else 0))
    tsplit = Split(devs.gpu_layers, target.n_layers, devs.device_bytes, devs.cpu_bytes)
    offloaded = sum(s.blocks for s in devs.shares)
    head = f"{offloaded}/{target.n_layers} target layers on {len([s for s in devs.shares if s.blocks])} device(s)"
    return Plan(tsplit, dsplit, "; ".join(x for x in (head, note) if x), devices=devs)
