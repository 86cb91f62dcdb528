"""Request validation at the service edge: a proto `GenerateRequest` becomes engine inputs.

Every check names the proto field and the limit, so a client can fix its request from the
message alone (the server turns `FieldError` into INVALID_ARGUMENT). The engine validates again
(`Engine.add_request`); its ValueErrors also start with the field name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from engine.runtime.engine import MAX_STOP_IDS
from engine.runtime.request import StopParams
from engine.runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams
from engine.runtime.speculative import drafters
from engine.service.proto import inference_pb2 as pb

DEFAULT_MAX_TOKENS = 64
# Proto drafter names -> engine names ("" : the server's default drafter).
DRAFTERS = {"": None, "none": drafters.OFF, drafters.OFF: drafters.OFF,
            drafters.AUTO: drafters.AUTO,
            **{alias: d.name for d in drafters.registry() for alias in (d.name, *d.aliases)}}
MAX_DRAFT_TOKENS = 16


class FieldError(ValueError):
  """A bad field in a request: `str(e)` starts with the field's path."""

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field = field


@dataclasses.dataclass(frozen=True)
class RequestLimits:
  """What the server accepts; model limits come from the engine (`limits_for`)."""
  vocab_size: int
  max_model_len: int
  num_eos_ids: int
  max_stop_strings: int = 8
  max_stop_string_chars: int = 256
  max_request_id_chars: int = 128
  max_prompt_chars: int = 1 << 20
  drafters: tuple[str, ...] = ()  # drafters the engine enables (requests may choose them)
  # Images in chat requests (`images.py`).
  max_images_per_request: int = 8
  max_image_bytes: int = 8 << 20  # an image file's bytes (decoded base64, fetched body)
  max_image_pixels: int = 4096 * 4096  # width x height, checked before decoding
  allow_image_urls: bool = False  # fetch http(s) image URLs (else refused)
  image_url_timeout_s: float = 10.0
  eos_token_ids: tuple[int, ...] = ()  # the engine's: where a grammar accepts, these may follow

  @property
  def max_stop_token_ids(self) -> int:
    return MAX_STOP_IDS - self.num_eos_ids


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
  """A validated request, ready for `Engine.add_request`."""
  request_id: str  # "" when the server should assign one
  prompt_ids: list[int]
  sampling: SamplingParams
  stop: StopParams
  images: tuple[Any, ...] = ()  # `multimodal.ImageInput`s, on media_pad runs of prompt_ids


def check_request_id(request_id: str, limits: RequestLimits) -> str:
  if len(request_id) > limits.max_request_id_chars:
    raise FieldError("request_id", f"{len(request_id)} characters, at most "
                     f"{limits.max_request_id_chars} allowed")
  if request_id and not request_id.isprintable():
    raise FieldError("request_id", "must be printable characters")
  return request_id


def check_prompt_chars(text: str, limits: RequestLimits) -> None:
  """Bounds the tokeniser's work before it starts."""
  if len(text) > limits.max_prompt_chars:
    raise FieldError("text", f"{len(text)} characters, at most {limits.max_prompt_chars} "
                     "allowed (the server's --max_prompt_chars)")


def encode(tokenizer: Any, text: str) -> list[int]:
  """Token ids of `text`. Through `encode_batch` where the tokenizer has it: the `tokenizers`
  binding's `encode` holds the GIL for the whole call (seconds for megabytes of text, every
  other thread stalled), its `encode_batch` releases it."""
  if hasattr(tokenizer, "encode_batch"):
    return list(tokenizer.encode_batch([text])[0].ids)
  return list(tokenizer.encode(text).ids)


def decode(tokenizer: Any, ids: list[int]) -> str:
  """Text of `ids` without special tokens (`decode_batch` releases the GIL, as in `encode`)."""
  if hasattr(tokenizer, "decode_batch"):
    return tokenizer.decode_batch([ids], skip_special_tokens=True)[0]
  return tokenizer.decode(ids, skip_special_tokens=True)


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> list[int]:
  for i, t in enumerate(ids):
    if not 0 <= t < vocab_size:
      raise FieldError(field, f"token id {t} at index {i} is outside the vocabulary "
                       f"[0, {vocab_size})")
  return list(ids)


def prompt_ids(request: Any, tokenizer: Any, limits: RequestLimits) -> list[int]:
  which = request.WhichOneof("prompt")
  if which is None:
    raise FieldError("prompt", "set text or token_ids")
  if which == "text":
    if not request.text:
      raise FieldError("text", "must not be empty")
    check_prompt_chars(request.text, limits)
    if tokenizer is None:
      raise FieldError("text", "this model has no tokenizer; send token_ids")
    ids = encode(tokenizer, request.text)
    if not ids:
      raise FieldError("text", "encodes to no tokens")
    return ids
  if not request.token_ids.ids:
    raise FieldError("token_ids", "must contain at least one token")
  return check_token_ids("token_ids.ids", request.token_ids.ids, limits.vocab_size)


def _opt(msg: Any, name: str, default: Any) -> Any:
  return getattr(msg, name) if msg.HasField(name) else default


def check_sampling(*, temperature: float, top_k: int, top_p: float, min_p: float, seed: int,
                   logprobs: int | None, prefix: str = "") -> SamplingParams:
  """Sampling values (defaults already applied) -> SamplingParams; fields named prefix+name."""
  if not math.isfinite(temperature) or temperature < 0:
    raise FieldError(prefix + "temperature", f"must be a finite number >= 0, got {temperature}")
  if top_k < 0:
    raise FieldError(prefix + "top_k", f"must be >= 0 (0 disables it), got {top_k}")
  if not 0.0 < top_p <= 1.0:  # also false for NaN
    raise FieldError(prefix + "top_p", f"must be in (0, 1], got {top_p}")
  if not 0.0 <= min_p <= 1.0:
    raise FieldError(prefix + "min_p", f"must be in [0, 1], got {min_p}")
  if not 0 <= seed < 2**32:
    raise FieldError(prefix + "seed", f"must be in [0, 2**32), got {seed}")
  return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        seed=seed, logprobs=logprobs)


def sampling_params(s: Any) -> SamplingParams:
  logprobs = None
  if s.HasField("top_logprobs"):
    if not s.logprobs:
      raise FieldError("sampling.top_logprobs", "requires sampling.logprobs = true")
    if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
      raise FieldError("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got "
                       f"{s.top_logprobs}")
    logprobs = s.top_logprobs
  elif s.logprobs:
    logprobs = 0
  return check_sampling(temperature=_opt(s, "temperature", 0.0), top_k=_opt(s, "top_k", 0),
                        top_p=_opt(s, "top_p", 1.0), min_p=_opt(s, "min_p", 0.0),
                        seed=_opt(s, "seed", 0), logprobs=logprobs, prefix="sampling.")


def check_stop(*, max_tokens: int | None, min_tokens: int, stop: Sequence[str],
               stop_token_ids: Sequence[int], ignore_eos: bool,
               include_stop_str_in_output: bool, num_prompt_tokens: int,
               limits: RequestLimits, prefix: str = "", max_tokens_field: str = "max_tokens",
               default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
               skip_special_tokens: bool = True, prompt_field: str = "prompt") -> StopParams:
  """Stop values -> StopParams; max_tokens None takes min(default_max_tokens, the room left
  in the context) (default None: all the room)."""
  room = limits.max_model_len - num_prompt_tokens
  if room < 1:
    raise FieldError(prompt_field, f"{num_prompt_tokens} tokens leave no room to generate within "
                     f"the context length {limits.max_model_len}")
  if max_tokens is not None:
    if max_tokens < 1:
      raise FieldError(prefix + max_tokens_field, f"must be >= 1, got {max_tokens}")
    if max_tokens > room:
      raise FieldError(prefix + max_tokens_field, f"prompt ({num_prompt_tokens} tokens) + "
                       f"{max_tokens_field} ({max_tokens}) exceeds the context length "
                       f"{limits.max_model_len}")
  else:
    max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
  if not 0 <= min_tokens <= max_tokens:
    raise FieldError(prefix + "min_tokens", f"must be in [0, max_tokens={max_tokens}], got "
                     f"{min_tokens}")
  if len(stop) > limits.max_stop_strings:
    raise FieldError(prefix + "stop", f"{len(stop)} stop strings, at most "
                     f"{limits.max_stop_strings} allowed")
  for i, text in enumerate(stop):
    if not text:
      raise FieldError(prefix + "stop", f"stop string {i} is empty")
    if len(text) > limits.max_stop_string_chars:
      raise FieldError(prefix + "stop", f"stop string {i} has {len(text)} characters, at most "
                       f"{limits.max_stop_string_chars} allowed")
  if len(stop_token_ids) > limits.max_stop_token_ids:
    raise FieldError(prefix + "stop_token_ids", f"{len(stop_token_ids)} ids, at most "
                     f"{limits.max_stop_token_ids} allowed")
  stop_ids = check_token_ids(prefix + "stop_token_ids", stop_token_ids, limits.vocab_size)
  return StopParams(max_tokens=max_tokens, min_tokens=min_tokens,
                    stop_token_ids=tuple(stop_ids), stop=tuple(stop), ignore_eos=ignore_eos,
                    include_stop_str_in_output=include_stop_str_in_output,
                    skip_special_tokens=skip_special_tokens)


def stop_params(s: Any, num_prompt_tokens: int, limits: RequestLimits,
                prompt_field: str = "prompt") -> StopParams:
  return check_stop(prompt_field=prompt_field, max_tokens=_opt(s, "max_tokens", None), min_tokens=_opt(s, "min_tokens", 0),
                    stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                    ignore_eos=s.ignore_eos,
                    include_stop_str_in_output=s.include_stop_str_in_output,
                    num_prompt_tokens=num_prompt_tokens, limits=limits, prefix="sampling.")


def check_speculative(spec: Any, limits: RequestLimits) -> dict[str, Any]:
  """The request's drafter and draft cap as `SamplingParams` fields."""
  if spec.drafter not in DRAFTERS:
    raise FieldError("speculative.drafter", f"unknown drafter {spec.drafter!r}; one of "
                     f"{[d for d in DRAFTERS if d]}")
  drafter = DRAFTERS[spec.drafter]
  if drafter == drafters.AUTO and not limits.drafters:
    raise FieldError("speculative.drafter", "'auto' chooses among the server's drafters and "
                     "it enables none (serve --speculative, --drafters)")
  if drafter not in (None, drafters.OFF, drafters.AUTO) and drafter not in limits.drafters:
    raise FieldError("speculative.drafter", f"{spec.drafter!r} is not enabled on this server "
                     f"(enabled: {', '.join(limits.drafters) or 'none'}; serve --speculative, "
                     f"--drafters)")
  if spec.HasField("max_draft_tokens") and not 1 <= spec.max_draft_tokens <= MAX_DRAFT_TOKENS:
    raise FieldError("speculative.max_draft_tokens", f"must be in [1, {MAX_DRAFT_TOKENS}], got "
                     f"{spec.max_draft_tokens}")
  return dict(drafter=drafter, max_draft_tokens=spec.max_draft_tokens
              if spec.HasField("max_draft_tokens") else None)


def parse_generate(request: "pb.GenerateRequest", tokenizer: Any,
                   limits: RequestLimits) -> ParsedRequest:
  """Validates a GenerateRequest; raises FieldError naming the first bad field."""
  rid = check_request_id(request.request_id, limits)
  ids = prompt_ids(request, tokenizer, limits)
  sampling = sampling_params(request.sampling)
  stop = stop_params(request.sampling, len(ids), limits)
  spec = check_speculative(request.speculative, limits)
  sampling = dataclasses.replace(sampling, **spec)
  return ParsedRequest(request_id=rid, prompt_ids=ids, sampling=sampling, stop=stop)
