"""OpenAI request bodies -> engine inputs, and engine outputs -> OpenAI response objects.

Validation follows `validation.py`: every check raises `FieldError` naming the JSON field as
OpenAI's `param` would (`messages[1].content`, `max_tokens`), and the HTTP layer answers 400
with it. Fields the engine cannot honour are refused rather than ignored (`echo`, `suffix`,
non-zero penalties, `logit_bias`); unknown fields are ignored, as OpenAI-compatible servers
do. `response_format` and vLLM's `structured_outputs` become a compiled output constraint
(`structured.py`; a bad schema, regex or grammar is a 400 naming it). Sampling defaults are
OpenAI's (temperature 1, a random seed unless `seed` is given, `max_tokens` up to the context
length).
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from typing import Any, Sequence

from engine.runtime.request import RequestOutput, TokenLogprob, Usage
from engine.runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams
from engine.service import structured, validation
from engine.service.validation import FieldError, ParsedRequest, RequestLimits

MAX_N = 16  # choices per request (each is an engine request)
MAX_PROMPTS = 64  # prompts in one completions batch
_MISSING = object()
_NUMBER = (int, float)


def _type_name(types: Any) -> str:
  names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
           list: "an array", dict: "an object"}
  types = types if isinstance(types, tuple) else (types,)
  if types == _NUMBER:
    return "a number"
  return " or ".join(names.get(t, t.__name__) for t in types)


def get(body: dict, name: str, types: Any, default: Any = None, field: str | None = None) -> Any:
  """body[name] checked against `types` (bool is not a number); None/absent -> default."""
  value = body.get(name, _MISSING)
  if value is _MISSING or value is None:
    return default
  types_t = types if isinstance(types, tuple) else (types,)
  if isinstance(value, bool) and bool not in types_t:
    ok = False
  else:
    ok = isinstance(value, types_t)
  if not ok:
    raise FieldError(field or name, f"must be {_type_name(types)}, got "
                     f"{type(value).__name__} {json.dumps(value)[:40]}")
  return value


def load_body(raw: bytes) -> dict:
  try:
    body = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise FieldError("body", f"not valid JSON: {e}") from None
  if not isinstance(body, dict):
    raise FieldError("body", f"must be a JSON object, got {type(body).__name__}")
  return body


@dataclasses.dataclass(frozen=True)
class Common:
  """What completions and chat share: the validated sampling and stop fields."""
  model: str
  n: int
  stream: bool
  include_usage: bool
  sampling: SamplingParams
  stop_fields: dict  # validation.check_stop keywords but the prompt length
  constraint: structured.Constraint | None = None  # response_format / structured_outputs


def check_model(body: dict, served: str) -> str:
  model = get(body, "model", str, served)
  if model != served:
    raise FieldError("model", f"the model `{model}` does not exist; this server serves "
                     f"`{served}` (GET /v1/models)")
  return model


def _refuse_unsupported(body: dict) -> None:
  for name in ("presence_penalty", "frequency_penalty"):
    if get(body, name, _NUMBER, 0) != 0:
      raise FieldError(name, "is not supported by this server (only 0)")
  if get(body, "repetition_penalty", _NUMBER, 1) != 1:
    raise FieldError("repetition_penalty", "is not supported by this server (only 1)")
  if get(body, "logit_bias", dict, {}):
    raise FieldError("logit_bias", "is not supported by this server")


def common(body: dict, limits: RequestLimits, served: str, *, logprobs: int | None,
           max_tokens_names: Sequence[str]) -> Common:
  model = check_model(body, served)
  _refuse_unsupported(body)
  n = get(body, "n", int, 1)
  if not 1 <= n <= MAX_N:
    raise FieldError("n", f"must be in [1, {MAX_N}], got {n}")
  stream = get(body, "stream", bool, False)
  options = get(body, "stream_options", dict, None)
  include_usage = False
  if options is not None:
    if not stream:
      raise FieldError("stream_options", "is only allowed with stream = true")
    include_usage = get(options, "include_usage", bool, False, "stream_options.include_usage")
  seed = get(body, "seed", int, None)
  top_k = get(body, "top_k", int, 0)
  sampling = validation.check_sampling(
      temperature=float(get(body, "temperature", _NUMBER, 1.0)), top_k=0 if top_k == -1 else top_k,
      top_p=float(get(body, "top_p", _NUMBER, 1.0)), min_p=float(get(body, "min_p", _NUMBER, 0.0)),
      seed=secrets.randbits(32) if seed is None else seed, logprobs=logprobs)
  max_tokens, field = None, max_tokens_names[0]
  for name in max_tokens_names:  # the first given wins (max_completion_tokens over max_tokens)
    value = get(body, name, int, None)
    if value is not None:
      max_tokens, field = value, name
      break
  stop = body.get("stop")
  if isinstance(stop, str):
    stop = [stop]
  elif stop is None:
    stop = []
  elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
    raise FieldError("stop", "must be a string or an array of strings")
  stop_ids = get(body, "stop_token_ids", list, [])
  if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
    raise FieldError("stop_token_ids", "must be an array of integers")
  stop_fields = dict(max_tokens=max_tokens, max_tokens_field=field,
                     min_tokens=get(body, "min_tokens", int, 0), stop=stop,
                     stop_token_ids=stop_ids, ignore_eos=get(body, "ignore_eos", bool, False),
                     include_stop_str_in_output=get(body, "include_stop_str_in_output", bool,
                                                    False),
                     limits=limits, default_max_tokens=None)
  return Common(model=model, n=n, stream=stream, include_usage=include_usage,
                sampling=sampling, stop_fields=stop_fields, constraint=structured.from_body(body))


def choice_requests(base_id: str, prompts: Sequence[list[int]], c: Common,
                    skip_special_tokens: bool = True,
                    prompt_field: str = "prompt", images: tuple = ()) -> list[ParsedRequest]:
  """One engine request per (prompt, choice), choice index = prompt * n + j. Choice j samples
  with seed + j, so n choices differ and a seeded request repeats."""
  requests = []
  for p, ids in enumerate(prompts):
    field = prompt_field if len(prompts) == 1 else f"{prompt_field}[{p}]"
    stop = validation.check_stop(num_prompt_tokens=len(ids), **c.stop_fields,
                                 skip_special_tokens=skip_special_tokens, prompt_field=field)
    for j in range(c.n):
      sampling = dataclasses.replace(c.sampling, seed=(c.sampling.seed + j) % 2**32)
      requests.append(ParsedRequest(f"{base_id}-{p * c.n + j}", ids, sampling, stop, images))
  return requests


# ---- /v1/completions -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CompletionPlan:
  id: str
  common: Common
  requests: list[ParsedRequest]
  logprobs: int | None
  return_token_ids: bool = False  # vLLM's extension: each choice carries its token ids


def _prompts(body: dict, tokenizer: Any, limits: RequestLimits) -> list[list[int]]:
  prompt = body.get("prompt", _MISSING)
  if prompt is _MISSING or prompt is None:
    raise FieldError("prompt", "is required")
  is_int = lambda t: isinstance(t, int) and not isinstance(t, bool)
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and is_int(prompt[0])):
    prompt = [prompt]
  if not isinstance(prompt, list) or not prompt:
    raise FieldError("prompt", "must be a string, an array of strings, an array of token ids "
                     "or an array of arrays of token ids, and not empty")
  if len(prompt) > MAX_PROMPTS:
    raise FieldError("prompt", f"{len(prompt)} prompts, at most {MAX_PROMPTS} allowed")
  out = []
  for i, p in enumerate(prompt):
    field = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
    if isinstance(p, str):
      if not p:
        raise FieldError(field, "must not be empty")
      if len(p) > limits.max_prompt_chars:
        raise FieldError(field, f"{len(p)} characters, at most {limits.max_prompt_chars} "
                         "allowed (the server's --max_prompt_chars)")
      if tokenizer is None:
        raise FieldError(field, "this model has no tokenizer; send token ids")
      ids = validation.encode(tokenizer, p)
      if not ids:
        raise FieldError(field, "encodes to no tokens")
    elif isinstance(p, list) and p and all(is_int(t) for t in p):
      ids = validation.check_token_ids(field, p, limits.vocab_size)
    else:
      raise FieldError(field, "must be a non-empty string or array of token ids")
    out.append(ids)
  return out


def parse_completion(raw: bytes, tokenizer: Any, limits: RequestLimits,
                     served: str, base_id: str | None = None) -> CompletionPlan:
  """A /v1/completions body -> engine requests (runs on a tokenizer thread)."""
  body = load_body(raw)
  if get(body, "echo", bool, False):
    raise FieldError("echo", "is not supported by this server")
  if get(body, "suffix", str, None):
    raise FieldError("suffix", "is not supported by this server")
  best_of = get(body, "best_of", int, None)
  logprobs = get(body, "logprobs", int, None)
  if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
    raise FieldError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
  c = common(body, limits, served, logprobs=logprobs, max_tokens_names=("max_tokens",))
  if best_of is not None and best_of != c.n:
    raise FieldError("best_of", "is not supported by this server (only equal to n)")
  prompts = _prompts(body, tokenizer, limits)
  spec = None
  if c.constraint is not None:
    spec = structured.compile_checked(c.constraint.spec, c.constraint.field, tokenizer, limits)
  plan_id = f"cmpl-{base_id or secrets.token_hex(12)}"
  requests = structured.constrain(choice_requests(plan_id, prompts, c), spec)
  return CompletionPlan(plan_id, c, requests, logprobs,
                        get(body, "return_token_ids", bool, False))


# ---- responses -----------------------------------------------------------------------------

def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict:
  return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def token_text(tokenizer: Any, token_id: int) -> str:
  if tokenizer is None:
    return f"token_id:{token_id}"
  return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Any, ids: Sequence[int], lps: Sequence[TokenLogprob],
                        offset: int) -> tuple[dict, int]:
  """The legacy completions logprobs object of one delta; returns it and the next offset."""
  tokens, token_lps, tops, offsets = [], [], [], []
  for token_id, lp in zip(ids, lps):
    text = token_text(tokenizer, token_id)
    tokens.append(text)
    token_lps.append(json_logprob(lp.logprob))
    tops.append({token_text(tokenizer, t): json_logprob(v) for t, v in lp.top})
    offsets.append(offset)
    offset += len(text)
  return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
          "text_offset": offsets}, offset


def chat_logprobs(tokenizer: Any, ids: Sequence[int], lps: Sequence[TokenLogprob]) -> list:
  """`logprobs.content` entries (token, logprob, bytes, top_logprobs) of one delta."""
  def entry(token_id: int, value: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": json_logprob(value), "bytes": list(text.encode())}
  return [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
          for t, lp in zip(ids, lps)]


def usage_json(prompt_usages: Sequence[Usage], completion_tokens: int,
               reasoning_tokens: int | None = None) -> dict:
  """Usage of a call: prompt tokens once per prompt, completion tokens over every choice."""
  prompt = sum(u.prompt_tokens for u in prompt_usages)
  out = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
         "total_tokens": prompt + completion_tokens,
         "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in prompt_usages)}}
  if reasoning_tokens is not None:
    out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
  return out


class UsageTally:
  """Usage over a call's choices: the first choice of each prompt stands for its prompt."""

  def __init__(self, n: int):
    self.n = n
    self.finals: dict[int, Usage] = {}

  def add(self, index: int, out: RequestOutput) -> None:
    if out.finished:
      self.finals[index] = out.usage

  def json(self, reasoning_tokens: int | None = None) -> dict:
    prompts = [u for i, u in sorted(self.finals.items()) if i % self.n == 0]
    completion = sum(u.completion_tokens for u in self.finals.values())
    return usage_json(prompts, completion, reasoning_tokens)


def now() -> int:
  return int(time.time())


def json_logprob(x: float) -> float:
  """JSON has no -inf: a token the model rules out reads -9999 (as vLLM writes it)."""
  return max(x, -9999.0) if not math.isnan(x) else -9999.0
