"""A fast, read-only view of a GGUF file: metadata scalars and tensors, nothing else.

`gguf.GGUFReader` builds Python objects for every vocabulary string and merge
(about 100K of them), which costs seconds on a small machine. Loading weights
needs none of them, so this reader skips arrays of strings by their lengths and
maps tensor data straight from the file; `gguf.quants` still does the
dequantization. 4-bit tensors can also be read as they are stored (`int4_groups`).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUF value types -> struct format (strings and arrays are handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml's 4-bit types: 32 weights per block, a fp16 scale d (Q4_1: and a fp16 minimum m), 16 bytes of
# nibbles; weight j of a block is the low nibble of byte j (j < 16) or the high one of byte j - 16.
_Q4_0, _Q4_1, _Q4_BLOCK = 2, 3, 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]     # numpy order (rows first), as dequantization returns it
    ggml_type: int
    offset: int                # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata (`meta`; string arrays and long arrays reduced to their length) and tensors of one GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        buffer = self._data
        if bytes(buffer[:4]) != _MAGIC:
            raise ValueError(f"{self.path.name} is not a GGUF file (no GGUF magic)")
        self._pos = 4
        version = self._scalar("<I")
        if version < 2:
            raise ValueError(f"{self.path.name}: GGUF version {version} is too old (expected 2 or later)")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        self.meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.meta[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.meta.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = {name: self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos}

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        text = bytes(self._data[self._pos:self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {kind}")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item == _STRING:  # skipped: the vocabulary is the tokenizer's business
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", self._data, self._pos)
                self._pos += 8 + length
            return count
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self._data, dtype=dtype, count=count, offset=self._pos)
            self._pos += dtype.itemsize * count
            return values.tolist() if count <= 1024 else count  # long arrays: the length only
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        count = int(np.prod(dims))
        return GGUFTensor(name, tuple(reversed(dims)), kind, offset, count // block * block_bytes)

    def array(self, name: str) -> np.ndarray:
        """A tensor dequantized to fp32, shaped rows first."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = self._data[info.offset:info.offset + info.nbytes]
        row_bytes = info.shape[-1] // block * block_bytes
        raw = raw.reshape(*info.shape[:-1], row_bytes)
        quant = getattr(quants, qtype.name, None)
        if quant is not None and hasattr(quant, "dequantize_rows"):
            # All rows in one call: `quants.dequantize` applies the same per-block arithmetic to 16 rows at
            # a time, which costs seconds of Python loops per model; the values are the same, bit for bit.
            quant.init_grid()
            values = quant.dequantize_rows(raw)
        else:   # F32, F16
            values = quants.dequantize(raw, qtype)
        return np.asarray(values, dtype=np.float32).reshape(info.shape)

    def int4_groups(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A Q4_0 or Q4_1 tensor as stored, not dequantized: the 4-bit values q (uint8 in 0..15,
        shaped like the tensor) and, per group of 32 along a row, fp32 `scale` and `offset` with
        weight = scale * q + offset (Q4_0: offset = -8 * scale). None for any other type."""
        info = self.tensors[name]
        if info.ggml_type not in (_Q4_0, _Q4_1) or len(info.shape) != 2:
            return None
        minimum = info.ggml_type == _Q4_1
        blocks = self._data[info.offset:info.offset + info.nbytes].reshape(-1, 20 if minimum else 18)
        scale = blocks[:, 0:2].view(np.float16).astype(np.float32)
        offset = blocks[:, 2:4].view(np.float16).astype(np.float32) if minimum else -8.0 * scale
        nibbles = blocks[:, 4:20] if minimum else blocks[:, 2:18]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1)
        rows, cols = info.shape
        groups = (rows, cols // _Q4_BLOCK)
        return q.reshape(rows, cols), scale.reshape(groups), offset.reshape(groups)
