"""The GPU protocol run by `bench/gpu_check.sh`: one Python process per stage, each appending
one JSON row per measurement to `$OUT/results.jsonl` as it is measured (`rows.Recorder`).

Stages, in priority order (`gpu_check.sh` gives each its own time limit):
  ceilings   XLA copy, read-only reduction and bf16 matmul of this run (`ceilings.py`): the
             denominators of every fraction after it
  int4       the W4A16 expert kernel (`int4.py`): its register plan bitwise and the MoE call
             against the reference, a configuration sweep, its time at Kimi K2.5 shapes (E 384
             x 1/8/64 tokens, a shard of 48 x 1/8), SASS opcode counts
  k25_slice  a Kimi K2.5-shaped slice: decode step, prefill chunk, verify costs (`k25_slice.py`)
  mla        MLA decode at K2.5 shapes with a split sweep and page 16 vs 64 (`mla.py`)
  experts    FP8 and bf16 experts (`experts.py --formats=fp8,bf16`)
  peers      torch's cuBLAS bf16 and int4 weight-only matmuls on the same bytes (`peers.py`,
             a separate process without JAX)
  summary    `summary.md` from results.jsonl (`bench/summarize.py`)
Opt-in, by name (`STAGES=ceilings,<stage>`): layers (issue 49, `layers.py`), eagle3 (issue 55:
an EAGLE-3 head's draft step against a K2.5 target decode step, `eagle3.py`).

`DRY_RUN=1` runs each stage at toy shapes on the CPU, the Mosaic GPU kernels in interpret
mode, and lowers the stage's real-shape GPU programs for CUDA (`jax.export`), so the protocol
cannot break between GPU runs.
"""
