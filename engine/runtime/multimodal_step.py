"""The engine's image work in a prefill step: encode the images a step reaches, and lay their
features out over the step's packed `[B, W]` block.

`ImageEncoder.block_features(segments, w, b)` finds every image whose placeholder span overlaps
a scheduled segment, takes its features from the request (encoded in an earlier chunk), else
from the `EncoderCache` (the same content sent before), else encodes it: all the step's
missing images in one `vision.encode_images` call (their patches concatenated; the tower
attends within each image). It returns `(features [B, W, H], mask [B, W])` for
`steps.model_step_embeds`, position p of an image's span taking feature row p - offset, so a
chunk that ends inside a span and the next chunk that finishes it each get their own rows.
None when no segment touches an image (the step runs the text-only program).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from engine.runtime.multimodal import EncoderCache, ImageInput, overlapping
from engine.runtime.step_description import ENCODE, StepDescription


class ImageEncoder:
  """The vision tower as the engine core uses it (no tower: `pad_id` None, every image
  refused): which images a step needs, the encoder-output cache; `run` executes the tower's
  step description (the model runner's `execute`)."""

  def __init__(self, cfg: Any, params: Any, cache_bytes: int, counters: dict[str, Any],
               run: Callable[[StepDescription], dict[str, Any]]):
    self.cfg, self.run = cfg, run
    has_tower = (isinstance(params, dict) and params.get("vision") is not None
                 and getattr(cfg, "vision", None) is not None)
    self.pad_id = getattr(cfg, "media_pad_token_id", None) if has_tower else None
    self.cache = EncoderCache(cache_bytes)
    self.counters = counters
    counters.update(images_encoded=0, image_encode_calls=0, image_encode_seconds=0.0)
    self.hidden = cfg.hidden_size
    self.dtype = params["embed"].dtype if isinstance(params, dict) else np.float32

  def stats(self) -> dict[str, Any]:
    return dict(encoder_cache_queries=self.cache.hits + self.cache.misses,
                encoder_cache_hits=self.cache.hits, encoder_cache_bytes=self.cache.num_bytes)

  def encode(self, images: Sequence[ImageInput]) -> list[np.ndarray]:
    """Features [num_tokens, H] of each image, in one tower call."""
    pixels = np.concatenate([im.pixel_values for im in images], axis=0).astype(np.float32)
    grids = np.asarray([im.grid_thw for im in images], np.int32)
    # Patches padded to a power of two: one compiled tower program per bucket, not per mix.
    bucket = max(64, 1 << (pixels.shape[0] - 1).bit_length())
    out = self.run(StepDescription(ENCODE, dict(pixels=pixels, grids=grids),
                                   dict(num_patches=bucket)))["features"]
    want = sum(im.num_tokens for im in images)
    if out.shape[0] != want:
      raise RuntimeError(f"the vision tower returned {out.shape[0]} rows for {want} "
                         "placeholder tokens")
    bounds = np.cumsum([0] + [im.num_tokens for im in images])
    return [out[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

  def block_features(self, segments: Sequence[Any], w: int, b: int
                     ) -> tuple[np.ndarray, np.ndarray] | None:
    """(features [b, w, H], mask [b, w]) for the step's rows (the engine's packing: each
    segment in ceil(n / w) rows of w tokens), None if no row holds an image position."""
    touched = [(seg, overlapping(seg.request.images, seg.start, seg.start + seg.num_tokens))
               for seg in segments]
    if not any(ims for _, ims in touched):
      return None
    self._ensure_features(touched)
    feats = np.zeros((b, w, self.hidden), self.dtype)
    mask = np.zeros((b, w), bool)
    r = 0
    for seg, ims in touched:
      req = seg.request
      for off in range(0, seg.num_tokens, w):
        lo = seg.start + off
        hi = seg.start + min(off + w, seg.num_tokens)
        for im in overlapping(ims, lo, hi):
          a, z = max(lo, im.offset), min(hi, im.end)
          rows = req.image_features[req.images.index(im)]
          feats[r, a - lo:z - lo] = rows[a - im.offset:z - im.offset]
          mask[r, a - lo:z - lo] = True
        r += 1
    return feats, mask

  def _ensure_features(self, touched: Sequence[tuple[Any, list[ImageInput]]]) -> None:
    """Every touched image's features on its request: kept, cached, or encoded now."""
    missing: dict[str, list[tuple[Any, int, ImageInput]]] = {}
    for seg, ims in touched:
      req = seg.request
      for im in ims:
        i = req.images.index(im)
        if i in req.image_features:
          continue
        hit = self.cache.get(im.content_hash)
        if hit is not None:
          req.image_features[i] = hit
        else:  # the same image twice in a step is encoded once
          missing.setdefault(im.content_hash, []).append((req, i, im))
    if not missing:
      return
    firsts = [users[0][2] for users in missing.values()]
    t0 = time.perf_counter()
    features = self.encode(firsts)
    dt = time.perf_counter() - t0
    self.counters["images_encoded"] += len(firsts)
    self.counters["image_encode_calls"] += 1
    self.counters["image_encode_seconds"] += dt
    for (key, users), feats in zip(missing.items(), features):
      self.cache.put(key, feats)
      for req, i, _ in users:
        req.image_features[i] = feats
    for req in {id(req): req for users in missing.values() for req, _, _ in users}.values():
      req.timings.encode_s += dt
