"""The synthetic test images of the `kimi_k25_vision` fixture, made by integer arithmetic only
(so the generator, in the reference environment, and the tests build the same pixels).

Each image is a smooth gradient with hashed noise on top (high frequencies, so a resize that
rounds differently shows), in mode RGB, RGBA (a varying alpha: composited on white) or L.
Sizes: some fit as they are (padding only), one is smaller than a patch, some hit the
fixture's per-side patch limit and one its total patch limit (its preprocessor_config.json:
max_patches 40, at most 8 patches a side).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# (height, width, mode): what each exercises with patch 14, merge 2, <= 8 patches a side and
# <= 40 patches in all.
IMAGE_CASES = [
    (30, 45, "RGB"),   # no resize; padded to 56 x 56
    (13, 9, "RGB"),    # smaller than one patch: padded to 28 x 28
    (150, 60, "RGB"),  # the per-side limit (112 px) shrinks it; tall
    (50, 200, "RGB"),  # the per-side limit; wide
    (100, 100, "RGB"),  # 49 patches > 40: the total limit shrinks it (to 90 x 90)
    (28, 56, "RGB"),   # whole 28-pixel groups: neither resized nor padded
    (40, 30, "RGBA"),  # transparency composited on white
    (33, 20, "L"),     # grayscale, expanded to RGB
]


def _hash(*xs: np.ndarray) -> np.ndarray:
  v = np.zeros(np.broadcast(*xs).shape, np.uint64)
  for k, x in zip((0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F), xs):
    v = (v + np.uint64(k) * np.asarray(x, np.uint64)) & np.uint64(0xFFFFFFFF)
    v ^= v >> np.uint64(15)
    v = (v * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    v ^= v >> np.uint64(12)
  return v


def make_image(index: int) -> Image.Image:
  """Test image `index` of IMAGE_CASES."""
  h, w, mode = IMAGE_CASES[index]
  channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
  y, x, c = np.meshgrid(np.arange(h), np.arange(w), np.arange(channels), indexing="ij")
  smooth = (x * (c + 1) * 255 // max(w - 1, 1) + y * (3 - c % 3) * 255 // max(h - 1, 1)) % 256
  noise = _hash(x, y, c, np.full_like(x, index + 1)) % np.uint64(256)
  pixels = ((3 * smooth + noise.astype(np.int64)) // 4).astype(np.uint8)
  return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)
