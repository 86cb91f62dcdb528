"""Speculative decoding: drafters propose tokens, one target forward verifies them losslessly.

* `acceptance`: the verification rule (greedy prefix match; speculative sampling otherwise).
* `drafters`: n-gram prompt lookup, DeepSeek MTP, a small draft model.
* `learned`: an on-device n-gram table learned across requests (`NgramMemory`).
* `goodput`: adaptive draft length.
* `loop`: `speculative_decode`, the jitted `lax.while_loop` next to `generate.decode`.
* `serving`: `speculative_decode_loop`, the serving engine's decode-only loop (drafter per row).
* `runtime`: `SpecRuntime`, the engine's speculative state, drafter feeding and cost model.
* `rest`: rests between speculative calls where speculation gave up (both paths).
"""
