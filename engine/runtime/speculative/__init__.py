"""Speculative decoding: drafters propose tokens, one target forward verifies them losslessly.

* `acceptance`: the verification rule (greedy prefix match; speculative sampling otherwise).
* `drafters`: n-gram prompt lookup and DeepSeek MTP; `learned`: an on-device n-gram table
  learned across requests; the draft model's feeding: `loop` and `catch_up`.
* `goodput`: acceptance estimates per draft position, and whether an iteration drafts.
* `costs`: the cost table T[B, k] (roofline, or timed at warm-up).
* `loop`: `speculative_decode_loop`, the one jitted draft-and-verify loop.
* `runtime`: `SpecRuntime`, the engine's speculative state and the per-call rule.
* `inplace`: `run_if`, a conditional that keeps large buffers in place.
"""
