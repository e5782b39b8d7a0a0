#!/usr/bin/env python3
"""Turn a GGUF into an HF-format checkpoint directory, dequantizing with gguf-py.

The directory (safetensors + config.json + tokenizer files) stands in for an F16 checkpoint in
tests and benchmarks; no real one exists on these machines.

    scripts/make_hf_fixture.py ~/.cache/edgerun/models/qwen2.5-coder-0.5b-instruct-q5_0.gguf /tmp/qwen05 --dtype bf16

The work is in testkit/fixture.py (test support, not installed); this is its command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for testkit

from edgerun.errors import EdgerunError  # noqa: E402
from testkit.fixture import DTYPES, SHARD_BYTES, make_hf_fixture  # noqa: E402


def _progress(label: str, done: int, total: int) -> None:
    print(f"\r{label}: {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="source GGUF (any type gguf-py can dequantize)")
    parser.add_argument("out_dir", type=Path, help="HF directory to create (must not exist)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="dtype of the 2-D weights (default bf16)")
    parser.add_argument("--shard-mb", type=int, default=SHARD_BYTES >> 20, help="safetensors shard size in MiB")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = make_hf_fixture(args.gguf, args.out_dir, dtype=args.dtype, shard_bytes=args.shard_mb << 20,
                              progress=_progress)
    except EdgerunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
