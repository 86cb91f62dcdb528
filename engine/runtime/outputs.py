"""Host-side token handling of the serving engine: what happens to a step's sampled tokens.

* `append_tokens`: appends them to the request, applying the stop rules in order (stop token
  ids after min_tokens, stop strings after detokenisation, max_tokens and the model length);
* `request_output`: the delta since the request's last output, text held back while it may
  still change (an incomplete UTF-8 sequence, a possible prefix of a stop string);
* `logprob_entry`: a request's logprobs entry from a program's outputs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from engine.runtime.request import (FINISH_LENGTH, FINISH_STOP, Request, RequestOutput,
                                    TokenLogprob)


def logprob_entry(req: Request, lps: tuple[np.ndarray, np.ndarray, np.ndarray],
                  at: tuple[int, ...]) -> TokenLogprob | None:
  """The request's logprobs entry from a program's (chosen, top ids, top logprobs) at `at`."""
  if req.sampling.logprobs is None:
    return None
  chosen, ids, lp = (x[at] for x in lps)
  k = req.sampling.logprobs
  return TokenLogprob(float(chosen), tuple((int(i), float(v)) for i, v in zip(ids[:k], lp[:k])))


def append_tokens(req: Request, new_ids: list[int],
                  logprobs: list[TokenLogprob | None] | None, tokenizer: Any,
                  max_model_len: int) -> str | None:
  """Appends sampled tokens, applying the stop rules in order; returns the finish reason if
  one fired. Tokens after a stop are dropped (the device loop may run past a stop string).
  The text is decoded once per call, or per token only while stop strings are watched."""
  reason, text_upto = None, None
  for i, tok in enumerate(new_ids):
    if req.timings.first_token is None:
      req.timings.first_token = time.monotonic()
    req.output_ids.append(tok)
    if req.thought is not None:
      req.thought.step(tok)
    if logprobs is not None and logprobs[i] is not None:
      req.output_logprobs.append(logprobs[i])
    n = len(req.output_ids)
    if tok in req.stop_ids and n >= req.stop.min_tokens:
      req.stop_reason, reason, text_upto = tok, FINISH_STOP, n - 1  # its text is not output
      break
    if req.stop.stop and _stop_string_hit(req, tokenizer):
      return FINISH_STOP  # req.text is already cut at the stop string
    if n >= req.stop.max_tokens or req.num_tokens >= max_model_len:
      reason = FINISH_LENGTH
      break
  if tokenizer is not None and new_ids:
    req.text = tokenizer.decode(req.output_ids[:text_upto],
                                skip_special_tokens=req.stop.skip_special_tokens)
  return reason


def _stop_string_hit(req: Request, tokenizer: Any) -> bool:
  if tokenizer is None:
    return False
  text = tokenizer.decode(req.output_ids, skip_special_tokens=req.stop.skip_special_tokens)
  req.text = text
  if len(req.output_ids) < req.stop.min_tokens:
    return False
  longest = max(len(s) for s in req.stop.stop)
  window_start = max(0, req.num_sent_chars - longest)
  hits = [(text.find(s, window_start), s) for s in req.stop.stop]
  hits = [(i, s) for i, s in hits if i >= 0]
  if not hits:
    return False
  i, s = min(hits)
  req.stop_reason = s
  req.text = text[:i + len(s)] if req.stop.include_stop_str_in_output else text[:i]
  return True


def request_output(req: Request, new_ids: list[int]) -> RequestOutput:
  """The delta since the last output. Text is held back while it may still change: an
  incomplete UTF-8 sequence, or a possible prefix of a stop string."""
  text = req.text
  if not req.finished:
    if text.endswith("\ufffd"):
      text = text.rstrip("\ufffd")
    if req.stop.stop:
      text = text[:max(req.num_sent_chars, len(text) - max(len(s) for s in req.stop.stop) + 1)]
  delta = text[req.num_sent_chars:] if len(text) > req.num_sent_chars else ""
  req.num_sent_chars += len(delta)
  return RequestOutput(request_id=req.request_id, new_token_ids=list(new_ids),
                       text_delta=delta, finished=req.finished,
                       finish_reason=req.finish_reason, usage=req.usage(),
                       timings=req.timings, stop_reason=req.stop_reason,
                       new_logprobs=(None if req.sampling.logprobs is None else
                                     req.output_logprobs[len(req.output_logprobs)
                                                         - len(new_ids):]))
