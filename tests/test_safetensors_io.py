"""The torch-free safetensors reader: dtypes, zero-copy views, header validation."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.model.safetensors_io import (SafetensorsError, SafetensorsFile, list_tensors,
                                         load_file, read_header)


def _all_dtypes():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 5)).astype(np.float32)
  return {
      "f32": x,
      "f16": x.astype(np.float16),
      "bf16": x.astype(ml_dtypes.bfloat16),
      "f8": x.astype(ml_dtypes.float8_e4m3fn),
      "f64": x.astype(np.float64)[0],
      "i8": np.arange(-4, 4, dtype=np.int8),
      "u8": np.arange(7, dtype=np.uint8).reshape(7, 1),
      "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
      "i64": np.arange(5, dtype=np.int64),
      "bool": np.array([True, False, True]),
      "empty": np.zeros((0, 4), np.float32),
      "scalar": np.array(3.5, np.float32),
  }


def test_reads_every_dtype_bit_exact(tmp_path):
  tensors = _all_dtypes()
  path = tmp_path / "a.safetensors"
  save_file(tensors, str(path), metadata={"format": "np"})
  with SafetensorsFile(path) as f:
    assert set(f.keys()) == set(tensors)
    assert f.metadata == {"format": "np"}
    for name, want in tensors.items():
      got = f.get(name)
      assert got.dtype == want.dtype, name
      assert got.shape == want.shape, name
      assert got.tobytes() == want.tobytes(), name
  loaded = load_file(path)
  assert loaded["bf16"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(loaded["f8"].astype(np.float32),
                                tensors["f8"].astype(np.float32))


def test_views_are_zero_copy_and_read_only(tmp_path):
  path = tmp_path / "a.safetensors"
  save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(path))
  f = SafetensorsFile(path)
  v = f.get("w")
  assert not v.flags.writeable
  assert not v.flags.owndata
  with pytest.raises(ValueError):
    v[0, 0] = 1.0
  copy = np.array(v)
  f.close()  # a live view keeps the map alive instead of crashing
  np.testing.assert_array_equal(copy, np.arange(12).reshape(3, 4))
  with pytest.raises(KeyError, match="nope"):
    SafetensorsFile(path).get("nope")


def test_list_tensors_reads_header_only(tmp_path):
  path = tmp_path / "a.safetensors"
  save_file({"a": np.zeros((2, 3), ml_dtypes.bfloat16), "b": np.zeros(4, np.int32)}, str(path))
  assert list_tensors(path) == {"a": ("BF16", (2, 3)), "b": ("I32", (4,))}
  tensors, _ = read_header(path)
  assert tensors["a"].nbytes == 12 and tensors["b"].nbytes == 16


def _write_raw(path, header, data=b""):
  raw = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_truncated_file_names_file_and_tensor(tmp_path):
  path = tmp_path / "t.safetensors"
  save_file({"big": np.ones((64, 64), np.float32)}, str(path))
  blob = path.read_bytes()
  path.write_bytes(blob[:-100])
  with pytest.raises(SafetensorsError, match=r"t\.safetensors.*truncated.*'big'"):
    SafetensorsFile(path)
  path.write_bytes(blob[:5])
  with pytest.raises(SafetensorsError, match=r"t\.safetensors.*truncated"):
    read_header(path)
  path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
  with pytest.raises(SafetensorsError, match="header length"):
    read_header(path)


@pytest.mark.parametrize("entry,match", [
    ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}, "unsupported dtype 'Q4'"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "invalid shape"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}, "invalid data_offsets"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "spans 8 bytes"),
])
def test_corrupt_header_entries(tmp_path, entry, match):
  path = tmp_path / "c.safetensors"
  _write_raw(path, {"x": entry}, b"\0" * 16)
  with pytest.raises(SafetensorsError, match=match) as e:
    read_header(path)
  assert "c.safetensors" in str(e.value) and "'x'" in str(e.value)


def test_invalid_json_and_overlap(tmp_path):
  path = tmp_path / "j.safetensors"
  path.write_bytes(struct.pack("<Q", 4) + b"{not")
  with pytest.raises(SafetensorsError, match="not valid JSON"):
    read_header(path)
  _write_raw(path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)
  with pytest.raises(SafetensorsError, match="overlap"):
    read_header(path)
