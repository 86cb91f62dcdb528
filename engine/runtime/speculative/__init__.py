"""Speculative decoding: drafters (`drafters/`: one module each behind `drafters.base.Drafter`,
chosen through the registry in `drafters/__init__.py`) propose tokens and one target forward
verifies them losslessly (`acceptance`), in one jitted device loop (`loop`) whose iterations
draft when the acceptance estimates (`goodput`) and the cost table (`costs`) say it pays;
`policy.SpecPolicy` is the engine core's speculative state and per-call rule (it describes each
speculative call as a step description the model runner executes); `inplace.run_if` keeps
large buffers in place.
"""
