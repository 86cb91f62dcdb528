"""Image inputs at the API edge: content parts -> decoded images -> the engine's `ImageInput`s.

A chat message's content parts may hold images: OpenAI's `{"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}` (also `"image_url": "<url>"`), and gRPC Chat's
`ContentPart.image` (the file's bytes, given here as `{"type": "image_bytes", ...}` by
`chat.proto_conversation`). `extract` finds them in message order, checks the request's limits
(`RequestLimits.max_images_per_request`, `max_image_bytes`, `max_image_pixels`) and decodes each
with Pillow (RGB), raising `FieldError` naming the part (`messages[1].content[2].image_url`)
for a corrupt file, bad base64, an unsupported or refused URL, too many or too large images.
http(s) URLs are refused unless the server allows them (`serve --allow_image_urls`); then they
are fetched here, on the tokenizer thread (never the event loop), with a timeout and the byte
limit. The template sees `{"type": "image"}` in the image's place.

`to_inputs` preprocesses the decoded images for the tower (`image_processing.preprocess`),
expands the prompt's single `<|media_pad|>` per image to `num_image_tokens` pads and hashes
each image's content (sha256 of its decoded RGB pixels, their size and the preprocessing
parameters), the key of the encoder cache and of the prefix cache's image-aware page keys.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Sequence

import numpy as np

from engine.model import image_processing
from engine.runtime.multimodal import ImageInput
from engine.service.validation import FieldError, RequestLimits

IMAGE_PART_TYPES = ("image_url", "image_bytes")


@dataclasses.dataclass(frozen=True)
class DecodedImage:
  field: str  # where it came from (error messages)
  image: Any  # PIL.Image.Image, RGB


def _pil():
  from PIL import Image  # the serving edge only
  return Image


def decode_image(data: bytes, field: str, limits: RequestLimits) -> Any:
  """An image file's bytes -> an RGB PIL image, transparency composited on white as
  transformers' processor does (FieldError naming `field` when it is none or over the
  limits); the pixel count is checked on the header, before decoding."""
  if len(data) > limits.max_image_bytes:
    raise FieldError(field, f"image of {len(data)} bytes, at most {limits.max_image_bytes} "
                     "allowed (the server's --max_image_bytes)")
  if not data:
    raise FieldError(field, "empty image")
  Image = _pil()
  try:
    img = Image.open(io.BytesIO(data))
    w, h = img.size
  except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError, ...
    raise FieldError(field, f"not a decodable image ({type(e).__name__})") from None
  if w * h > limits.max_image_pixels:
    raise FieldError(field, f"image of {w}x{h} = {w * h} pixels, at most "
                     f"{limits.max_image_pixels} allowed (the server's --max_image_pixels)")
  try:
    img.load()
    # As the tower's preprocessing reads it (transparency composited on white): the pixels
    # the content hash covers.
    return Image.fromarray(image_processing.to_rgb_array(img), "RGB")
  except Exception as e:
    raise FieldError(field, f"not a decodable image ({type(e).__name__}: {e})") from None


def _data_url(url: str, field: str, limits: RequestLimits) -> bytes:
  head, sep, payload = url.partition(",")
  if not sep:
    raise FieldError(field, "data: URL without ',' before its payload")
  if not head.endswith(";base64"):
    raise FieldError(field, "data: URLs must be base64 (data:image/png;base64,...)")
  if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
    raise FieldError(field, f"image of ~{len(payload) * 3 // 4} bytes, at most "
                     f"{limits.max_image_bytes} allowed (the server's --max_image_bytes)")
  try:
    return base64.b64decode(payload.strip(), validate=True)
  except (binascii.Error, ValueError) as e:
    raise FieldError(field, f"not valid base64: {e}") from None


def fetch_url(url: str, field: str, limits: RequestLimits) -> bytes:
  """GET an http(s) image with the server's time and byte limits. Any host the server can
  reach is fetched (internal ones too): enable URLs only where that is acceptable."""
  try:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "moejax"}),
                                timeout=limits.image_url_timeout_s) as resp:
      length = resp.headers.get("Content-Length", "")
      if length.isdigit() and int(length) > limits.max_image_bytes:
        raise FieldError(field, f"image of {length} bytes, at most {limits.max_image_bytes} "
                         "allowed (the server's --max_image_bytes)")
      # The timeout bounds each socket operation; the deadline the whole body (a slow drip).
      deadline = time.monotonic() + limits.image_url_timeout_s
      chunks, size = [], 0
      while size <= limits.max_image_bytes:
        chunk = resp.read(min(1 << 16, limits.max_image_bytes + 1 - size))
        if not chunk:
          break
        chunks.append(chunk)
        size += len(chunk)
        if time.monotonic() > deadline:
          raise FieldError(field, f"could not fetch the image within "
                           f"{limits.image_url_timeout_s} s (the server's --image_url_timeout_s)")
      data = b"".join(chunks)
  except FieldError:
    raise
  except (urllib.error.URLError, OSError, ValueError) as e:
    raise FieldError(field, f"could not fetch the image: {e}") from None
  if len(data) > limits.max_image_bytes:
    raise FieldError(field, f"image over {limits.max_image_bytes} bytes (the server's "
                     "--max_image_bytes)")
  return data


def image_url_bytes(value: Any, field: str, limits: RequestLimits) -> bytes:
  """An OpenAI `image_url` value ({"url": ...} or the URL) -> the file's bytes."""
  url = value.get("url") if isinstance(value, dict) else value
  if isinstance(value, dict):
    field_url = field + ".url"
  else:
    field_url = field
  if not isinstance(url, str) or not url:
    raise FieldError(field_url, "must be a data: or http(s) URL string")
  scheme = urllib.parse.urlsplit(url[:64]).scheme.lower() if ":" in url[:64] else ""
  if scheme == "data":
    return _data_url(url, field, limits)
  if scheme in ("http", "https"):
    if not limits.allow_image_urls:
      raise FieldError(field, "http(s) image URLs are not fetched by this server (serve "
                       "--allow_image_urls enables it); send the image as a data: URL")
    return fetch_url(url, field, limits)
  raise FieldError(field, f"unsupported URL scheme {scheme!r}: a data: URL (or http(s) where "
                   "the server allows it)")


def extract(messages: Any, limits: RequestLimits) -> tuple[Any, list[DecodedImage]]:
  """The messages with each image part replaced by {"type": "image"}, and the decoded images
  in order. Messages that are not shaped as expected are passed through untouched (the
  template's validation names what is wrong with them)."""
  if not isinstance(messages, list):
    return messages, []
  found: list[DecodedImage] = []
  out = []
  for i, msg in enumerate(messages):
    content = msg.get("content") if isinstance(msg, dict) else None
    if not isinstance(content, list):
      out.append(msg)
      continue
    parts = []
    for j, part in enumerate(content):
      kind = part.get("type") if isinstance(part, dict) else None
      if kind == "image":  # the template's own marker: a client may not send it bare
        raise FieldError(f"messages[{i}].content[{j}].type", "'image' parts carry no image; "
                         "send {\"type\": \"image_url\", \"image_url\": {\"url\": ...}}")
      if kind not in IMAGE_PART_TYPES:
        parts.append(part)
        continue
      if kind == "image_url":
        field = f"messages[{i}].content[{j}].image_url"
        if len(found) >= limits.max_images_per_request:
          raise FieldError(field, f"more than {limits.max_images_per_request} images in the "
                           "request (the server's --max_images_per_request)")
        data = image_url_bytes(part.get("image_url"), field, limits)
      else:
        field = f"messages[{i}].content_parts[{j}].image"
        if len(found) >= limits.max_images_per_request:
          raise FieldError(field, f"more than {limits.max_images_per_request} images in the "
                           "request (the server's --max_images_per_request)")
        data = part["image_bytes"]
      found.append(DecodedImage(field, decode_image(data, field, limits)))
      parts.append({"type": "image"})
    out.append({**msg, "content": parts})
  return out, found


def content_hash(image: Any, processor: Any) -> str:
  """sha256 of the decoded RGB pixels, their size and the preprocessing parameters."""
  h = hashlib.sha256(b"moejax-image-v1")
  h.update(repr((image.size, image.mode, processor)).encode())
  h.update(image.tobytes())
  return h.hexdigest()


def expand(ids: Sequence[int], pad_id: int, token_counts: Sequence[int]
           ) -> tuple[list[int], list[tuple[int, int]]]:
  """Each image's single placeholder -> its token count of pads
  (`image_processing.expand_image_placeholders`); returns the ids and each image's (offset,
  tokens). FieldError("messages") when the template rendered another number of placeholders
  than there are images."""
  try:
    out = image_processing.expand_image_placeholders(ids, token_counts, pad_id)
  except image_processing.ImageError as e:
    raise FieldError("messages", f"the chat template rendered: {e}") from None
  slots = [i for i, t in enumerate(ids) if t == pad_id]
  grown = np.cumsum([0] + [int(n) - 1 for n in token_counts])
  return out, [(slot + int(g), int(n)) for slot, g, n in zip(slots, grown, token_counts)]


def to_inputs(ids: Sequence[int], found: Sequence[DecodedImage], pad_id: int,
              processor: Any) -> tuple[list[int], tuple[ImageInput, ...]]:
  """Preprocesses the images, expands each placeholder to its token count; returns the
  prompt ids and the request's `ImageInput`s."""
  batches = []
  for im in found:
    try:
      batch = image_processing.preprocess([im.image], processor)
    except ValueError as e:
      raise FieldError(im.field, f"cannot be preprocessed: {e}") from None
    grid = tuple(int(x) for x in batch.grid_thws[0])
    batches.append((batch.pixel_values, grid,
                    int(image_processing.num_image_tokens(grid, processor))))
  ids, spans = expand(ids, pad_id, [n for _, _, n in batches])
  return ids, tuple(
      ImageInput(pixel_values=pixels, grid_thw=grid, content_hash=content_hash(im.image,
                                                                               processor),
                 offset=offset, num_tokens=n)
      for im, (pixels, grid, _), (offset, n) in zip(found, batches, spans))
