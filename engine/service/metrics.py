"""Prometheus metrics for the server (vLLM's names with the `moejax:` prefix).

Engine gauges and counters are read from `Engine.stats()` at scrape time (one source of truth,
no double counting); per-request histograms (TTFT, inter-token latency, end-to-end, queue,
prefill and decode time, prompt and generation tokens) and finish-reason counts are observed by
the stream handlers, which see each request's whole life. Every sample carries vLLM's
`model_name` label. Everything lives in the server's own registry, so several servers in one
process (tests) do not collide in the global one.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "moejax:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)

# Engine.stats() key -> (metric name, help). Counters get `_total` appended on export.
ENGINE_GAUGES = {
    "num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "Fraction of KV cache pages in use (0-1)."),
}
ENGINE_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens admitted."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "Requests preempted (pages released, recomputed)."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix "
                             "cache (full pages only)."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served by the prefix cache."),
    "prefix_cache_hits_lacking_drafter_entries": (
        "prefix_cache_hits_lacking_drafter_entries", "Of those, tokens served to rows drafting "
        "with an MTP layer or EAGLE-3 head on pages lacking its cache entries (a plain decode "
        "wrote them); it drafts over them as they are."),
    "images_encoded": ("images_encoded", "Images run through the vision tower."),
    "encoder_cache_queries": ("encoder_cache_queries", "Images looked up in the encoder-output "
                              "cache (by content hash)."),
    "encoder_cache_hits": ("encoder_cache_hits", "Images whose encoder output came from the "
                           "cache (not encoded again)."),
    "image_encode_seconds": ("image_encode_seconds", "Seconds spent in vision tower calls."),
}
# The pool counts prefix-cache lookups in pages; vLLM's counters are in tokens.
PAGE_COUNTED = ("prefix_cache_queries", "prefix_cache_hits",
                "prefix_cache_hits_lacking_drafter_entries")
# Speculative decoding counters (zero when the engine does not speculate): metric name ->
# (engine counter, help). Mean accepted length = 1 + accepted / drafts.
SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("spec_steps", "Draft-and-verify steps (row x step)."),
    "spec_decode_num_draft_tokens": ("spec_drafted", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("spec_accepted", "Draft tokens accepted."),
}


class _EngineCollector:
  """Reads the engine's gauges and counters at scrape time."""

  def __init__(self, stats: Callable[[], dict[str, Any]], page_size: int, model_name: str):
    self._stats = stats
    self._page_size = page_size
    self._model_name = model_name

  def collect(self) -> Iterator[Any]:
    for family in self._families():
      family.samples = [sample._replace(labels={"model_name": self._model_name, **sample.labels})
                        for sample in family.samples]
      yield family

  def _families(self) -> Iterator[Any]:
    s = self._stats()
    for key, (name, doc) in ENGINE_GAUGES.items():
      yield GaugeMetricFamily(PREFIX + name, doc, value=float(s[key]))
    for key, (name, doc) in ENGINE_COUNTERS.items():
      scale = self._page_size if key in PAGE_COUNTED else 1
      yield CounterMetricFamily(PREFIX + name, doc, value=float(s[key] * scale))
    for name, (key, doc) in SPEC_COUNTERS.items():
      yield CounterMetricFamily(PREFIX + name, doc, value=float(s.get(key, 0)))
      # The same counts split by drafter (engine keys `<key>_<drafter>`).
      split = CounterMetricFamily(PREFIX + name + "_by_drafter", doc + " By drafter.",
                                  labels=["drafter"])
      for k, v in s.items():
        if k.startswith(key + "_") and k.count("_") == key.count("_") + 1:
          split.add_metric([k[len(key) + 1:]], float(v))
      if split.samples:
        yield split
    per_pos = {name: CounterMetricFamily(PREFIX + name, doc, labels=["position"])
               for name, doc in (
                   ("spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed at each "
                    "draft position (0-based)."),
                   ("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                    "draft position (0-based)."))}
    estimate = GaugeMetricFamily(
        PREFIX + "spec_decode_acceptance_estimate", "The adaptive draft length's current "
        "estimate of P(draft at this position accepted | earlier ones were), by drafter.",
        labels=["drafter", "position"])
    for k, v in s.items():
      parts = k.split("_")  # spec_pos{j}_{drafted|accepted} and spec_pos{j}_estimate_{drafter}
      if len(parts) < 3 or parts[0] != "spec" or not parts[1].startswith("pos"):
        continue
      pos = parts[1][3:]
      if parts[2] == "estimate":
        estimate.add_metric(["_".join(parts[3:]), pos], float(v))
      else:
        per_pos["spec_decode_num_%s_tokens_per_pos" % (
            "draft" if parts[2] == "drafted" else "accepted")].add_metric([pos], float(v))
    for family in (*per_pos.values(), estimate):
      if family.samples:
        yield family
    loops = CounterMetricFamily(PREFIX + "spec_decode_loop_iterations",
                                "Speculative loop iterations by the draft length k the adaptive "
                                "policy chose (k=0: plain decoding).", labels=["k"])
    for k, v in s.items():
      if k.startswith("spec_k") and k.endswith("_loops"):
        loops.add_metric([k[len("spec_k"):-len("_loops")]], float(v))
    if loops.samples:
      yield loops
    # The acceptance estimates' calibration: tokens expected vs emitted when drafting.
    model = CounterMetricFamily(PREFIX + "spec_decode_model", "The adaptive draft length's "
                                "estimates against what happened: tokens expected / emitted "
                                "in iterations that drafted.", labels=["quantity"])
    for q in ("expected_tokens", "emitted_tokens"):
      if "spec_model_" + q in s:
        model.add_metric([q], float(s["spec_model_" + q]))
    if model.samples:
      yield model
    if "spec_cost_break_even" in s:
      yield GaugeMetricFamily(PREFIX + "spec_decode_break_even_batch", "The smallest decode "
                              "batch at which speculation cannot pay by the cost table (0: "
                              "none).", value=float(s["spec_cost_break_even"]))


def token_buckets(max_tokens: int) -> tuple[int, ...]:
  """1, 2, 5, 10, 20, 50, ... up to max_tokens (vLLM's build_1_2_5_buckets)."""
  out, scale = [], 1
  while True:
    for m in (1, 2, 5):
      if m * scale > max_tokens:
        return tuple(out)
      out.append(m * scale)
    scale *= 10


class _ModelLabelled:
  """A labelled metric whose `model_name` label is already set."""

  def __init__(self, metric: Any, model_name: str):
    self._metric, self._model_name = metric, model_name

  def labels(self, **labels: str) -> Any:
    return self._metric.labels(model_name=self._model_name, **labels)


class ServingMetrics:
  """The server's metric registry."""

  def __init__(self, engine_stats: Callable[[], dict[str, Any]], page_size: int,
               model_name: str = "", max_model_len: int = 1 << 17):
    self.registry = CollectorRegistry()
    self.registry.register(_EngineCollector(engine_stats, page_size, model_name))
    r, m = self.registry, ["model_name"]

    def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
      return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r).labels(model_name)

    self.request_success = _ModelLabelled(Counter(
        PREFIX + "request_success", "Finished requests by reason.", m + ["finished_reason"],
        registry=r), model_name)
    self.request_rejected = _ModelLabelled(Counter(
        PREFIX + "request_rejected", "Requests refused before admission, by gRPC status code.",
        m + ["code"], registry=r), model_name)
    self.client_aborts = Counter(PREFIX + "client_aborts", "Requests aborted because the "
                                 "client cancelled or its deadline passed.", m,
                                 registry=r).labels(model_name)
    self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                          LATENCY_BUCKETS)
    self.itl = histogram("inter_token_latency_seconds", "Gap between streamed chunks divided "
                         "by their tokens.", LATENCY_BUCKETS)
    self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
    self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                LATENCY_BUCKETS)
    self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first "
                                  "token.", LATENCY_BUCKETS)
    self.decode_time = histogram("request_decode_time_seconds", "First token to finish.",
                                 LATENCY_BUCKETS)
    tokens = token_buckets(max_model_len)
    self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of finished "
                                   "requests.", tokens)
    self.generation_tokens = histogram("request_generation_tokens", "Tokens generated by "
                                       "finished requests.", tokens)

  def observe_finished(self, reason: str, timings: Any, usage: Any = None) -> None:
    self.request_success.labels(finished_reason=reason).inc()
    t = timings
    prefill = (None if t.first_token is None or t.first_scheduled is None
               else t.first_token - t.first_scheduled)
    decode = None if t.finished is None or t.first_token is None else t.finished - t.first_token
    for hist, value in ((self.ttft, t.ttft_s), (self.e2e, t.e2e_s), (self.queue_time, t.queue_s),
                        (self.prefill_time, prefill), (self.decode_time, decode)):
      if value is not None:
        hist.observe(value)
    if usage is not None:
      self.prompt_tokens.observe(usage.prompt_tokens)
      self.generation_tokens.observe(usage.completion_tokens)

  def text(self) -> str:
    return generate_latest(self.registry).decode()

  def serve_http(self, port: int, addr: str = "127.0.0.1") -> Any:
    """Starts the /metrics endpoint in a daemon thread; returns the HTTP server."""
    httpd, _ = start_http_server(port, addr=addr, registry=self.registry)
    return httpd
