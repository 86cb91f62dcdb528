"""Speculative decoding: drafters (`drafters`, `learned`, the draft model fed lazily by
`catch_up`) propose tokens and one target forward verifies them losslessly (`acceptance`), in
one jitted device loop (`loop`) whose iterations draft when the acceptance estimates
(`goodput`) and the cost table (`costs`) say it pays; `runtime.SpecRuntime` is the engine's
speculative state and per-call rule; `inplace.run_if` keeps large buffers in place.
"""
