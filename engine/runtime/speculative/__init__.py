"""Speculative decoding: drafters propose tokens, one target forward verifies them losslessly.

* `acceptance`: the verification rule (greedy prefix match; speculative sampling otherwise).
* `drafters`: n-gram prompt lookup, DeepSeek MTP, a small draft model.
* `loop`: `speculative_decode`, the jitted `lax.while_loop` next to `generate.decode`.
"""
