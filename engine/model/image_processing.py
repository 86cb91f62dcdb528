"""Kimi K2.5 image preprocessing in numpy / Pillow, bit for bit transformers' processor.

    cfg = ImageProcessorConfig.from_dir(ckpt_dir)          # preprocessor_config.json
    batch = preprocess([pil_image, ...], cfg)              # ImageBatch
    batch.pixel_values  # float32 [sum of patches, 3, 14, 14], images in order, patches raster
    batch.grid_thws     # int32 [n_images, 3]: (1, patch rows, patch columns)
    num_image_tokens(batch.grid_thws[i], cfg)              # <|media_pad|> slots of image i
    expand_image_placeholders(ids, batch.num_tokens(cfg), pad_id)  # one pad per image -> n

The reference is transformers 5.24's `Kimi_K25ImageProcessor` (torchvision backend, the only
one it has): RGB (transparency composited on white), `navit_resize` (never upscale; at most
`max_patches` patches and `max_patches_per_side` per side), a uint8 bicubic antialiased resize
(torch's uint8 kernel: Pillow's algorithm with int16 fixed-point weights, not Pillow's 22-bit
ones, so Pillow's own resize differs by one level in some pixels; reproduced here in integer
arithmetic, so the result does not depend on the CPU), zero padding at the bottom and right to
a multiple of patch_size * merge_size, (x - 255 mean) / (255 std) in float32, and patches
flattened in raster order as [C, p, p] each.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Sequence

import numpy as np
from PIL import Image

PREPROCESSOR_FILE = "preprocessor_config.json"
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' PILImageResampling.BICUBIC


class ImageError(ValueError):
  """An image or preprocessor config that cannot be processed (the problem named)."""


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
  """The fields of `preprocessor_config.json` the K2.5 processor uses (transformers' names)."""
  patch_size: int = 14
  merge_size: int = 2
  max_patches: int = 16384
  max_patches_per_side: int = 512  # transformers' size.max_height (= max_width), in patches
  image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
  image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
  rescale_factor: float = 1 / 255
  do_resize: bool = True
  do_rescale: bool = True
  do_normalize: bool = True
  do_convert_rgb: bool = True

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ImageProcessorConfig":
    """transformers' keys (`max_patches`, `size.max_height`, `merge_size`, ...); the hub's
    remote-code `media_proc_cfg` keys (`in_patch_limit`, `patch_limit_on_one_side`,
    `merge_kernel_size`) where transformers' are absent."""
    media = d.get("media_proc_cfg") if isinstance(d.get("media_proc_cfg"), dict) else {}

    def get(key: str, media_key: str | None, default: Any) -> Any:
      if d.get(key) is not None:
        return d[key]
      if media_key and media.get(media_key) is not None:
        return media[media_key]
      return default

    size = d.get("size") or {}
    if not isinstance(size, dict):
      raise ImageError(f"{PREPROCESSOR_FILE}: 'size' must be an object, got {size!r}")
    if size and (size.get("max_height") is None or size.get("max_height") != size.get("max_width")):
      raise ImageError(f"{PREPROCESSOR_FILE}: 'size' must have equal 'max_height' and "
                       f"'max_width', got {size}")
    per_side = size.get("max_height") if size else media.get("patch_limit_on_one_side", 512)
    merge = get("merge_size", "merge_kernel_size", 2)
    if isinstance(merge, (list, tuple)):
      if len(set(merge)) != 1:
        raise ImageError(f"{PREPROCESSOR_FILE}: non-square merge kernel {merge} is not supported")
      merge = merge[0]
    resample = d.get("resample", BICUBIC)
    if resample != BICUBIC:
      raise ImageError(f"{PREPROCESSOR_FILE}: resample={resample!r} is not supported (only "
                       f"bicubic, {BICUBIC})")
    cfg = cls(patch_size=int(get("patch_size", "patch_size", 14)), merge_size=int(merge),
              max_patches=int(get("max_patches", "in_patch_limit", 16384)),
              max_patches_per_side=int(per_side),
              image_mean=_triple(get("image_mean", "image_mean", cls.image_mean), "image_mean"),
              image_std=_triple(get("image_std", "image_std", cls.image_std), "image_std"),
              rescale_factor=float(d.get("rescale_factor", 1 / 255)),
              do_resize=bool(d.get("do_resize", True)), do_rescale=bool(d.get("do_rescale", True)),
              do_normalize=bool(d.get("do_normalize", True)),
              do_convert_rgb=bool(d.get("do_convert_rgb", True)))
    if min(cfg.patch_size, cfg.merge_size, cfg.max_patches, cfg.max_patches_per_side) < 1:
      raise ImageError(f"{PREPROCESSOR_FILE}: patch_size, merge_size, max_patches and "
                       f"size.max_height must be positive, got {cfg}")
    return cfg

  @classmethod
  def from_dir(cls, ckpt_dir: str) -> "ImageProcessorConfig":
    path = os.path.join(os.fspath(ckpt_dir), PREPROCESSOR_FILE)
    if not os.path.exists(path):
      raise ImageError(f"no {PREPROCESSOR_FILE} in {ckpt_dir}")
    with open(path) as fh:
      try:
        return cls.from_dict(json.load(fh))
      except json.JSONDecodeError as e:
        raise ImageError(f"{path}: not valid JSON ({e})") from e


def _triple(v: Any, name: str) -> tuple[float, float, float]:
  if isinstance(v, (int, float)):
    v = [v] * 3
  if not isinstance(v, (list, tuple)) or len(v) != 3:
    raise ImageError(f"{PREPROCESSOR_FILE}: {name!r} must be 3 numbers, got {v!r}")
  return tuple(float(x) for x in v)


@dataclasses.dataclass(frozen=True)
class ImageBatch:
  """Preprocessed images: what the vision tower takes."""
  pixel_values: np.ndarray  # float32 [sum of patches, 3, p, p]
  grid_thws: np.ndarray  # int32 [n_images, 3]

  def num_tokens(self, cfg: ImageProcessorConfig) -> list[int]:
    return [num_image_tokens(g, cfg) for g in self.grid_thws]


# ---- sizes ----------------------------------------------------------------------------------

def navit_resize(height: int, width: int, cfg: ImageProcessorConfig
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
  """((resized h, w), (padded h, w)) as transformers' `navit_resize` computes them."""
  p, side = cfg.patch_size, cfg.max_patches_per_side
  count = max(1.0, height // p) * max(1.0, width // p)
  scale = min(1.0, math.sqrt(cfg.max_patches / count), side * p / height, side * p / width)
  new_h = min(max(1, int(height * scale)), side * p)
  new_w = min(max(1, int(width * scale)), side * p)
  factor = cfg.merge_size * p
  return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def image_grid(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
  """The (t, h, w) patch grid an image of this size becomes (without processing it)."""
  if cfg.do_resize:
    _, (height, width) = navit_resize(height, width, cfg)
  return 1, height // cfg.patch_size, width // cfg.patch_size


def num_image_tokens(grid_thw: Sequence[int], cfg: ImageProcessorConfig) -> int:
  """<|media_pad|> tokens of an image: its patches after the merge_size x merge_size merge."""
  t, h, w = (int(x) for x in grid_thw)
  return t * h * w // (cfg.merge_size ** 2)


def expand_image_placeholders(ids: Sequence[int], tokens_per_image: Sequence[int],
                              pad_id: int) -> list[int]:
  """A rendered prompt with one `pad_id` (<|media_pad|>) per image -> each repeated to its
  image's token count, as transformers' processor expands `<|media_pad|>` per image."""
  ids = [int(t) for t in ids]
  slots = [i for i, t in enumerate(ids) if t == pad_id]
  if len(slots) != len(tokens_per_image):
    raise ImageError(f"the prompt has {len(slots)} image placeholders (<|media_pad|>, id "
                     f"{pad_id}) for {len(tokens_per_image)} images")
  out: list[int] = []
  prev = 0
  for slot, n in zip(slots, tokens_per_image):
    out += ids[prev:slot] + [pad_id] * int(n)
    prev = slot + 1
  return out + ids[prev:]


# ---- torch's uint8 antialiased bicubic resize -----------------------------------------------

def _cubic_aa(x: np.ndarray) -> np.ndarray:
  """Pillow's bicubic filter (a = -0.5), which torch's antialiased uint8 kernel uses."""
  a = -0.5
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _int16_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(first input index [out], int16-valued weights [out, k], precision bits) as torch's
  `_compute_index_ranges_int16_weights` (antialias, align_corners=False) makes them: float64
  filter taps normalised per output, then scaled by the most bits that keep the largest weight
  in int16 and rounded half away from zero."""
  scale = in_size / out_size
  support = 2.0 * scale if scale >= 1.0 else 2.0
  invscale = 1.0 / scale if scale >= 1.0 else 1.0
  k = int(math.ceil(support)) * 2 + 1
  center = scale * (np.arange(out_size) + 0.5)
  starts = np.maximum(np.floor(center - support + 0.5), 0).astype(np.int64)
  ends = np.minimum(np.floor(center + support + 0.5).astype(np.int64), in_size)
  sizes = np.clip(ends - starts, 0, k)
  j = np.arange(k)
  w = _cubic_aa((j[None, :] + starts[:, None] - center[:, None] + 0.5) * invscale)
  w = np.where(j[None, :] < sizes[:, None], w, 0.0)
  total = np.cumsum(w, axis=1)[:, -1]  # summed in order, as torch does (np.sum pairs terms)
  w = w / np.where(total != 0.0, total, 1.0)[:, None]
  wt_max = float(w.max())
  precision = 0
  while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
    precision += 1
  v = w * (1 << precision)
  return starts, np.trunc(np.where(v < 0, v - 0.5, v + 0.5)).astype(np.int64), precision


def _resample_axis(img: np.ndarray, out_size: int, axis: int) -> np.ndarray:
  """One pass of the separable resize along `axis` of a uint8 [H, W, C] image (exact integer
  sums, one tap at a time so memory stays one output image)."""
  in_size = img.shape[axis]
  starts, w, precision = _int16_weights(in_size, out_size)
  x = np.moveaxis(img, axis, 0)  # [in, other, C]
  acc = np.full((out_size,) + x.shape[1:], 1 << (precision - 1), np.int64)
  for j in range(w.shape[1]):
    if w[:, j].any():  # taps past an output's window have weight 0 (index clamped in range)
      acc += w[:, j, None, None] * x[np.minimum(starts + j, in_size - 1)]
  out = np.clip(acc >> precision, 0, 255).astype(np.uint8)
  return np.moveaxis(out, 0, axis)


def resize_bicubic_uint8(img: np.ndarray, height: int, width: int) -> np.ndarray:
  """uint8 [H, W, C] -> [height, width, C]: torch's `interpolate(mode="bicubic",
  antialias=True)` on uint8 (horizontal pass, then vertical, each rounded to uint8)."""
  if img.shape[:2] == (height, width):
    return img
  if img.shape[1] != width:
    img = _resample_axis(img, width, 1)
  if img.shape[0] != height:
    img = _resample_axis(img, height, 0)
  return img


# ---- the processor --------------------------------------------------------------------------

def to_rgb_array(image: Image.Image) -> np.ndarray:
  """uint8 [H, W, 3] as transformers' `convert_to_rgb` (transparency composited on white)."""
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    image = image.convert("RGBA")
    background = Image.new("RGBA", image.size, (255, 255, 255, 255))
    image = Image.alpha_composite(background, image)
  return np.asarray(image.convert("RGB"), dtype=np.uint8)


def _normalize(img: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
  """uint8 [H, W, C] -> float32 [C, H, W], fused as transformers does: (x - mean / r) / (std / r)
  with the float32 mean and std scaled by 1 / rescale_factor in float32."""
  x = np.ascontiguousarray(img.transpose(2, 0, 1)).astype(np.float32)
  if cfg.do_normalize:
    inv = np.float32(1.0 / cfg.rescale_factor) if cfg.do_rescale else np.float32(1.0)
    mean = np.asarray(cfg.image_mean, np.float32) * inv
    std = np.asarray(cfg.image_std, np.float32) * inv
    return (x - mean[:, None, None]) / std[:, None, None]
  if cfg.do_rescale:
    return x * np.float32(cfg.rescale_factor)
  return x


def preprocess_one(image: Image.Image, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple]:
  """One image -> (float32 [patches, 3, p, p], (1, grid h, grid w))."""
  if not isinstance(image, Image.Image):
    raise ImageError(f"expected a PIL image, got {type(image).__name__}")
  if image.width < 1 or image.height < 1:
    raise ImageError(f"image has no pixels ({image.width}x{image.height})")
  arr = to_rgb_array(image) if cfg.do_convert_rgb else np.asarray(image, np.uint8)
  if arr.ndim != 3 or arr.shape[2] != 3:
    raise ImageError(f"image has shape {arr.shape}, expected [H, W, 3]")
  p = cfg.patch_size
  h, w = arr.shape[:2]
  if cfg.do_resize:
    (h, w), (ph, pw) = navit_resize(h, w, cfg)
    arr = resize_bicubic_uint8(arr, h, w)
    arr = np.pad(arr, ((0, ph - h), (0, pw - w), (0, 0)))
  elif h % p or w % p:
    raise ImageError(f"image {w}x{h} is not a whole number of {p}-pixel patches "
                     f"(do_resize is false)")
  x = _normalize(arr, cfg)
  c, hh, ww = x.shape
  gh, gw = hh // p, ww // p
  patches = x.reshape(c, gh, p, gw, p).transpose(1, 3, 0, 2, 4).reshape(gh * gw, c, p, p)
  return np.ascontiguousarray(patches), (1, gh, gw)


def preprocess(images: Sequence[Image.Image], cfg: ImageProcessorConfig) -> ImageBatch:
  """Images -> ImageBatch (pixel values concatenated in order, one grid row per image)."""
  if not images:
    raise ImageError("no images")
  outs = [preprocess_one(im, cfg) for im in images]
  return ImageBatch(pixel_values=np.concatenate([o[0] for o in outs]),
                    grid_thws=np.asarray([o[1] for o in outs], np.int32).reshape(-1, 3))
