"""The importance matrix as data: per weight, the mean x^2 of each input column, saved as .npz.

Apart from calibrate.py (which measures it, with llama.cpp) so that the quantizer's child process
reads it without importing what calibration needs."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.convert.atomic import atomic_path
from edgerun.errors import ConvertError

_META = ("__tokens__", "__chunks__")


@dataclass
class Imatrix:
    """Per weight name, the mean of x^2 per input column (float32, n_expert * n_cols for expert
    tensors, as llama.cpp's quantizer expects), and how much text it was measured on."""

    values: dict[str, np.ndarray]
    tokens: int
    chunks: int

    def save(self, path: str | Path) -> Path:
        """Write as .npz (no pickled objects), atomically and durably."""
        path = Path(path)
        arrays = {f"w:{name}": np.asarray(v, dtype=np.float32) for name, v in self.values.items()}
        arrays[_META[0]] = np.array(self.tokens, dtype=np.int64)
        arrays[_META[1]] = np.array(self.chunks, dtype=np.int64)
        with atomic_path(path) as tmp, open(tmp, "xb") as f:
            np.savez(f, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Imatrix":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                values = {k[2:]: z[k].astype(np.float32) for k in z.files if k.startswith("w:")}
                tokens, chunks = int(z[_META[0]]), int(z[_META[1]])
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise ConvertError(f"{path}: not an edgerun imatrix file ({e}); delete it to recalibrate") from e
        return cls(values=values, tokens=tokens, chunks=chunks)
