"""A safe `.safetensors` reader: no torch, no pickle, memory-mapped numpy views.

File layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the data buffer; offsets are relative to the start of the buffer.

`SafetensorsFile(path)` parses and validates the header (dtypes, shapes, offsets against the file
size) without touching the data, so a truncated or corrupt file fails early with an error naming
it. `get(name)` returns a read-only numpy view on the mmap (no copy until the caller makes one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
from typing import Any, Iterator

import ml_dtypes
import numpy as np

# safetensors dtype code -> numpy dtype (little-endian, as the format mandates).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")

# The reference implementation refuses headers above 100 MB; a larger one means corruption.
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
  """A `.safetensors` file that is corrupt, truncated or uses an unknown dtype (file named)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One header entry. `begin`/`end` are absolute byte offsets in the file."""
  name: str
  dtype: str  # safetensors code, e.g. "BF16"
  shape: tuple[int, ...]
  begin: int
  end: int

  @property
  def np_dtype(self) -> np.dtype:
    return DTYPES[self.dtype]

  @property
  def nbytes(self) -> int:
    return self.end - self.begin


def _parse_header(path: str, raw: bytes, file_size: int) -> tuple[dict[str, TensorInfo],
                                                                  dict[str, str]]:
  """Validates the JSON header; returns (tensors by name, __metadata__)."""
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from e
  if not isinstance(header, dict):
    raise SafetensorsError(f"{path}: header is not a JSON object")
  metadata = header.pop("__metadata__", None) or {}
  if not isinstance(metadata, dict):
    raise SafetensorsError(f"{path}: __metadata__ is not a JSON object")
  data_start = 8 + len(raw)
  data_size = file_size - data_start
  tensors: dict[str, TensorInfo] = {}
  for name, entry in header.items():
    if not isinstance(entry, dict):
      raise SafetensorsError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
      raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    if (not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
      raise SafetensorsError(f"{path}: tensor {name!r} has invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]):
      raise SafetensorsError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
      raise SafetensorsError(
          f"{path}: tensor {name!r} spans {end - begin} bytes but {dtype}{shape} needs {expected}")
    if end > data_size:
      raise SafetensorsError(
          f"{path}: truncated or corrupt: tensor {name!r} ends at byte {data_start + end} but "
          f"the file has {file_size} bytes")
    tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)
  # Overlapping tensors would alias each other: the format forbids it, so it means corruption.
  spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
  for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
    if begin_b < end_a:
      raise SafetensorsError(f"{path}: tensors {a!r} and {b!r} overlap")
  return tensors, {str(k): str(v) for k, v in metadata.items()}


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
  """Reads only the header: (tensors by name, __metadata__). Raises SafetensorsError."""
  path = os.fspath(path)
  try:
    file_size = os.path.getsize(path)
    with open(path, "rb") as fh:
      head = fh.read(8)
      if len(head) < 8:
        raise SafetensorsError(f"{path}: truncated or corrupt: {file_size} bytes, no header")
      (n,) = struct.unpack("<Q", head)
      if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise SafetensorsError(
            f"{path}: truncated or corrupt: header length {n} does not fit a file of "
            f"{file_size} bytes")
      raw = fh.read(n)
  except OSError as e:
    raise SafetensorsError(f"{path}: cannot read ({e})") from e
  return _parse_header(path, raw, file_size)


def list_tensors(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
  """{name: (dtype code, shape)} from the header alone."""
  tensors, _ = read_header(path)
  return {name: (t.dtype, t.shape) for name, t in tensors.items()}


class SafetensorsFile:
  """An open, memory-mapped `.safetensors` file. Use as a context manager.

  `tensors` maps names to `TensorInfo`; `get(name)` is a read-only zero-copy view that stays
  valid while the file is open (copy it before `close()` if it must outlive the file).
  """

  def __init__(self, path: str):
    self.path = os.fspath(path)
    self.tensors, self.metadata = read_header(self.path)
    self._mmap: mmap.mmap | None = None

  def _map(self) -> mmap.mmap:
    if self._mmap is None:
      with open(self.path, "rb") as fh:
        # The file may have shrunk since the header was read.
        size = os.fstat(fh.fileno()).st_size
        last = max((t.end for t in self.tensors.values()), default=0)
        if size < last:
          raise SafetensorsError(f"{self.path}: truncated: {size} bytes, data needs {last}")
        self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return self._mmap

  def keys(self) -> list[str]:
    return list(self.tensors)

  def __contains__(self, name: str) -> bool:
    return name in self.tensors

  def __iter__(self) -> Iterator[str]:
    return iter(self.tensors)

  def get(self, name: str) -> np.ndarray:
    """The tensor as a read-only numpy view on the memory map."""
    info = self.tensors.get(name)
    if info is None:
      raise KeyError(f"{self.path}: no tensor {name!r}")
    count = math.prod(info.shape)
    if count == 0:
      return np.zeros(info.shape, info.np_dtype)
    arr = np.frombuffer(self._map(), dtype=info.np_dtype, count=count, offset=info.begin)
    return arr.reshape(info.shape)

  def close(self) -> None:
    if self._mmap is not None:
      try:
        self._mmap.close()
      except BufferError:
        # Views handed out are still alive; the map is released when the last one is collected.
        pass
      self._mmap = None

  def __enter__(self) -> "SafetensorsFile":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def load_file(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a file as an owned numpy array (copies; for small files and tests)."""
  with SafetensorsFile(path) as f:
    return {name: np.array(f.get(name)) for name in f.keys()}
