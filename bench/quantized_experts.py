"""Routed experts as INT4 (kept packed), FP8 and bf16: bytes a decode step reads, and CPU time.

    python -m bench.quantized_experts --batch=1,8,64 --out=quantized_experts.json

Two parts, side by side per expert format:
* `kimi_k25`: bytes one decode step must read for Kimi K2.5's real shapes (61 layers, 384
  experts top-8, hidden 7168, expert width 2048; `param_shapes`), per batch size B: every
  non-expert weight (bf16) plus the expected distinct experts the B tokens route to
  (E (1 - (1 - k/E)^B) per MoE layer, uniform routing) in INT4 (packed nibbles + bf16 scale per
  32: 4.5 bits), FP8 (e4m3 + float32 scale per 128 x 128 block) or bf16; no KV cache. On paper:
  the weights' part of the bandwidth floor.
* `cpu`: the same step measured on this machine on a small model of the same architecture
  (random weights; `--hidden`, `--experts`, ...): median device seconds of one jitted decode
  step (forward + greedy logits, T = 1, `--context` cached tokens), experts as `Int4Weight`
  (dequantized inside the step),
  `Fp8Weight` (float8 + float32 scale per 128 x 128 block, dequantized inside the step) and
  bf16 arrays, and the bytes that step reads in each.
Writes JSON with both parts.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
from absl import app, flags

from bench.decode_profile import bytes_floor, step_time
from bench.expert_bytes import FORMATS, INT4, KIMI_K25_TEXT, step_weight_bytes
from engine.model.config import config_from_dict
from engine.model.kernels import REFERENCE
from engine.model.params import init_params

# --batch, --context, --iters and --out are bench.decode_profile's flags (imported above).
flags.DEFINE_integer("hidden", 512, "CPU model: hidden size.")
flags.DEFINE_integer("experts", 32, "CPU model: routed experts.")
flags.DEFINE_integer("expert_width", 512, "CPU model: moe_intermediate_size.")
flags.DEFINE_integer("layers", 4, "CPU model: layers (the first dense).")
FLAGS = flags.FLAGS

def cpu_model(fmt: str):
  d = dict(KIMI_K25_TEXT, vocab_size=4096, hidden_size=FLAGS.hidden,
           intermediate_size=2 * FLAGS.hidden, moe_intermediate_size=FLAGS.expert_width,
           num_hidden_layers=FLAGS.layers, num_attention_heads=8, n_routed_experts=FLAGS.experts,
           q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
           v_head_dim=32, max_position_embeddings=4096)
  cfg = config_from_dict(d)
  if fmt == "int4":
    cfg = dataclasses.replace(cfg, int4=INT4)
  elif fmt == "fp8":
    cfg = dataclasses.replace(cfg, fp8_experts=(128, 128))
  return cfg, init_params(cfg, seed=0, dtype=jnp.bfloat16)


def main(argv):
  del argv
  batches = [int(b) for b in FLAGS.batch]
  k25 = config_from_dict(KIMI_K25_TEXT)
  paper = []
  for b in batches:
    row = {"batch": b}
    for fmt in FORMATS:
      parts = step_weight_bytes(k25, fmt, b)
      row[fmt] = dict(total_gb=(parts["other"] + parts["experts"]) / 1e9,
                      experts_gb=parts["experts"] / 1e9, other_gb=parts["other"] / 1e9)
    row["distinct_experts_per_layer"] = step_weight_bytes(k25, "bf16", b)[
        "distinct_experts_per_layer"]
    paper.append(row)

  cpu = []
  models = {fmt: cpu_model(fmt) for fmt in FORMATS}
  for b in batches:
    row = {"batch": b}
    for fmt, (cfg, params) in models.items():
      row[fmt] = dict(step_s=step_time(cfg, params, b, FLAGS.context, REFERENCE, FLAGS.iters),
                      bytes_read=bytes_floor(cfg, params, b, FLAGS.context))
    cpu.append(row)

  result = dict(kimi_k25=dict(config=k25.display_name, rows=paper),
                cpu=dict(config=models["bf16"][0].display_name, context=FLAGS.context,
                         device=jax.devices()[0].device_kind, rows=cpu))
  print("Kimi K2.5 weights read per decode step (GB): batch | int4 | fp8 | bf16 | experts hit")
  for r in paper:
    print(f"  {r['batch']:4d} | {r['int4']['total_gb']:7.2f} | {r['fp8']['total_gb']:7.2f} | "
          f"{r['bf16']['total_gb']:7.2f} | {r['distinct_experts_per_layer']:.1f}/layer")
  print(f"CPU {result['cpu']['config']}, context {FLAGS.context}: batch | ms (MB read) "
        f"for " + " | ".join(FORMATS))
  for r in cpu:
    print(f"  {r['batch']:4d} | " + " | ".join(
        f"{r[f]['step_s'] * 1e3:7.2f} ({r[f]['bytes_read'] / 1e6:.1f})" for f in FORMATS))
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(result, fh, indent=2)


if __name__ == "__main__":
  app.run(main)
