"""Prometheus metrics for the server (vLLM's names with the `moejax:` prefix).

Engine gauges and counters are read from `Engine.stats()` at scrape time (one source of truth,
no double counting); per-request histograms (TTFT, inter-token latency, end-to-end, queue time)
and finish-reason counts are observed by the stream handlers, which see each request's whole
life. Everything lives in the server's own registry, so several servers in one process (tests)
do not collide in the global one.
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
}
# The pool counts prefix-cache lookups in pages; vLLM's counters are in tokens.
PAGE_COUNTED = ("prefix_cache_queries", "prefix_cache_hits")
# Speculative decoding counters (zero when the engine does not speculate): metric name ->
# (engine counter, help). Mean accepted length = 1 + accepted / drafts.
SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("spec_steps", "Draft-and-verify steps (row x step)."),
    "spec_decode_num_draft_tokens": ("spec_drafted", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("spec_accepted", "Draft tokens accepted."),
}


class _EngineCollector:
  """Reads the engine's gauges and counters at scrape time."""

  def __init__(self, stats: Callable[[], dict[str, Any]], page_size: int):
    self._stats = stats
    self._page_size = page_size

  def collect(self) -> Iterator[Any]:
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
    # The goodput model's calibration (tokens expected vs emitted when drafting; speculative
    # calls' time predicted vs measured, in plain-loop iterations) and the live cost correction.
    model = CounterMetricFamily(PREFIX + "spec_decode_model", "The adaptive draft length's "
                                "model against what happened: tokens expected / emitted in "
                                "iterations that drafted; speculative calls' time predicted / "
                                "measured (plain-loop iterations).", labels=["quantity"])
    for q in ("expected_tokens", "emitted_tokens", "predicted_cost", "measured_cost"):
      if "spec_model_" + q in s:
        model.add_metric([q], float(s["spec_model_" + q]))
    if model.samples:
      yield model
    if "spec_cost_scale" in s:
      yield GaugeMetricFamily(PREFIX + "spec_decode_cost_scale", "Measured over predicted time "
                              "of speculative calls (decayed): the factor applied to the cost "
                              "model's speculative step times.", value=float(s["spec_cost_scale"]))


class ServingMetrics:
  """The server's metric registry."""

  def __init__(self, engine_stats: Callable[[], dict[str, Any]], page_size: int):
    self.registry = CollectorRegistry()
    self.registry.register(_EngineCollector(engine_stats, page_size))
    r = self.registry
    self.request_success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                   ["finished_reason"], registry=r)
    self.request_rejected = Counter(PREFIX + "request_rejected", "Requests refused before "
                                    "admission, by gRPC status code.", ["code"], registry=r)
    self.client_aborts = Counter(PREFIX + "client_aborts", "Requests aborted because the "
                                 "client cancelled or its deadline passed.", registry=r)
    self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                          buckets=LATENCY_BUCKETS, registry=r)
    self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Gap between streamed chunks "
                         "divided by their tokens.", buckets=LATENCY_BUCKETS, registry=r)
    self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
                         buckets=LATENCY_BUCKETS, registry=r)
    self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first "
                                "scheduled.", buckets=LATENCY_BUCKETS, registry=r)

  def observe_finished(self, reason: str, timings: Any) -> None:
    self.request_success.labels(finished_reason=reason).inc()
    for hist, value in ((self.ttft, timings.ttft_s), (self.e2e, timings.e2e_s),
                        (self.queue_time, timings.queue_s)):
      if value is not None:
        hist.observe(value)

  def text(self) -> str:
    return generate_latest(self.registry).decode()

  def serve_http(self, port: int, addr: str = "0.0.0.0") -> Any:
    """Starts the /metrics endpoint in a daemon thread; returns the HTTP server."""
    httpd, _ = start_http_server(port, addr=addr, registry=self.registry)
    return httpd
