"""What the engine core hands the model runner: one program call, as host data only.

The core (requests, scheduler, pages, outputs, the speculative policy) decides a step; the
runner (`runner.ModelRunner`: compiled programs, the device cache, drafters' device state)
executes it. Between them is a `StepDescription`: a kind, named host numpy arrays and plain
scalars, never a Python object, closure or device array. Every input of the program is in it
(the rows, their sampling parameters, the speculative cost table and estimates, each row's
drafter and draft limit, time budgets, grammar bitmasks, image pixels and features) or is
runner state that earlier descriptions determined (the KV cache, the learned table, the draft
model's cache). So a runner fed the same descriptions in the same order runs the same programs
on the same inputs: what a follower host of a multi-host replica needs, which receives
`to_bytes()` and rebuilds it with `from_bytes()` (no pickle).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np

# Kinds of step (the runner's programs).
MIXED = "mixed"  # prefill chunks and decodes packed as [B, W] rows (`steps.model_step`)
DECODE = "decode"  # the plain decode loop (`steps.decode_loop`, or with learners)
SPEC_DECODE = "spec_decode"  # the speculative loop (`speculative.loop`)
MASKED = "masked"  # constrained rows' masked step (`steps.masked_step`)
DRAFTER = "drafter"  # a drafter's own program (scalar "drafter": its name; the draft catch-up)
ENCODE = "encode_images"  # the vision tower over a step's missing images
CLEAR_NULL_PAGE = "clear_null_page"  # page 0 zeroed again (after timing calls wrote there)
KINDS = (MIXED, DECODE, SPEC_DECODE, MASKED, DRAFTER, ENCODE, CLEAR_NULL_PAGE)

_MAGIC = b"MJSD\x01"
_ALIGN = 64
Scalar = bool | int | float | str


def _check_array(name: str, x: Any) -> np.ndarray:
  if not isinstance(x, np.ndarray):
    raise TypeError(f"step description array {name!r}: a numpy array, not "
                    f"{type(x).__name__}")
  if x.dtype.kind not in "biuf" and x.dtype.name != "bfloat16":
    raise TypeError(f"step description array {name!r}: dtype {x.dtype} is not numeric")
  return x


def _check_scalar(name: str, x: Any) -> Scalar:
  if isinstance(x, np.generic):
    x = x.item()
  if not isinstance(x, (bool, int, float, str)):
    raise TypeError(f"step description scalar {name!r}: bool, int, float or str, not "
                    f"{type(x).__name__}")
  return x


@dataclasses.dataclass
class StepDescription:
  """One program call of the runner: `kind` (one of KINDS), host arrays and scalars."""
  kind: str
  arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  scalars: dict[str, Scalar] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown step kind {self.kind!r}; one of {KINDS}")
    self.arrays = {k: _check_array(k, v) for k, v in self.arrays.items()}
    self.scalars = {k: _check_scalar(k, v) for k, v in self.scalars.items()}

  def with_prefix(self, prefix: str) -> dict[str, np.ndarray]:
    """The arrays named `prefix.<name>`, by <name>."""
    p = prefix + "."
    return {k[len(p):]: v for k, v in self.arrays.items() if k.startswith(p)}

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in self.arrays.values())

  def to_bytes(self) -> bytes:
    """magic, header length (u32), a JSON header (kind, scalars, each array's name, dtype,
    shape and offset), then the arrays' bytes, each aligned to 64."""
    specs, chunks, offset = [], [], 0
    for name, x in self.arrays.items():
      x = np.ascontiguousarray(x)
      pad = -offset % _ALIGN
      chunks.append(b"\0" * pad)
      offset += pad
      specs.append([name, x.dtype.name, list(x.shape), offset])
      chunks.append(x.tobytes())
      offset += x.nbytes
    header = json.dumps({"kind": self.kind, "scalars": self.scalars, "arrays": specs},
                        separators=(",", ":")).encode()
    head = _MAGIC + struct.pack("<I", len(header)) + header
    head += b"\0" * (-len(head) % _ALIGN)
    return head + b"".join(chunks)

  @staticmethod
  def from_bytes(data: bytes | memoryview) -> "StepDescription":
    """The description `to_bytes` wrote (arrays are read-only views of `data`)."""
    data = memoryview(data)
    if bytes(data[:len(_MAGIC)]) != _MAGIC:
      raise ValueError("not a step description (bad magic)")
    (n,) = struct.unpack_from("<I", data, len(_MAGIC))
    start = len(_MAGIC) + 4
    header = json.loads(bytes(data[start:start + n]))
    body = start + n + (-(start + n) % _ALIGN)
    arrays = {}
    for name, dtype, shape, offset in header["arrays"]:
      dt = _dtype(dtype)
      count = int(np.prod(shape, dtype=np.int64))
      arrays[name] = np.frombuffer(data, dt, count, body + offset).reshape(shape)
    return StepDescription(header["kind"], arrays, header["scalars"])

  def same_as(self, other: "StepDescription") -> bool:
    """Equal kind, scalars and arrays (dtype, shape and values)."""
    return (self.kind == other.kind and self.scalars == other.scalars
            and self.arrays.keys() == other.arrays.keys()
            and all(self.arrays[k].dtype == other.arrays[k].dtype
                    and np.array_equal(self.arrays[k], other.arrays[k]) for k in self.arrays))


def _dtype(name: str) -> np.dtype:
  try:
    return np.dtype(name)
  except TypeError:  # bfloat16: numpy knows it once JAX has registered ml_dtypes' types
    import jax.numpy as jnp
    return np.dtype(jnp.dtype(name))


def sampling_arrays(s: Any, prefix: str = "sampling") -> dict[str, np.ndarray]:
  """A `SamplingArrays`' fields as description arrays `sampling.<field>`."""
  return {f"{prefix}.{f.name}": np.asarray(getattr(s, f.name)) for f in dataclasses.fields(s)}
