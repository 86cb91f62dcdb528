import numpy as np, jax, jax.numpy as jnp
import engine
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
m = engine.load("tests/golden/fixtures/kimi_k25_int4", dtype="float32", progress=False)
g = dict(np.load("tests/golden/fixtures/kimi_k25_int4/golden.npz"))
eng = Engine(m.config, m.params, EngineConfig(page_size=8, max_num_seqs=2, max_num_batched_tokens=32, row_widths=(16,), max_model_len=64, cache_dtype=jnp.float32))
outs = eng.generate([g["prompt_0"].tolist(), g["prompt_1"].tolist()], stop=StopParams(max_tokens=32, ignore_eos=True))
for i,r in enumerate(outs): print(r.output_ids == g[f"greedy_{i}"].tolist())
