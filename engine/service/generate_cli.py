"""Command-line generation from an Orbax or Hugging Face checkpoint.

    python -m engine.generate --prompt="def fib(n):" --max_new_tokens=32   # the demo model
    python -m engine.generate --checkpoint=DIR --prompt="def fib(n):" --max_new_tokens=32
    python -m engine.generate --checkpoint=DIR --prompt_ids=1,2,3 --temperature=0 --json
    python -m engine.generate --checkpoint=DIR --mesh=tensor:4,expert:2 --prompt="..."

`--prompt` and `--prompt_ids` may be repeated to run a batch. `--json` prints one JSON object per
prompt (one line each) with `token_ids` (generated ids only), `text`, `finish_reason`,
`prompt_tokens`, and with `--speculative` a `spec` object (drafted, accepted, mean accepted
length = tokens per target forward).

    python -m engine.generate --prompt="import os" --speculative=mtp --num_draft_tokens=2
    python -m engine.generate --prompt="import os" --speculative=draft   # demo draft model
    python -m engine.generate --prompt="import os" --speculative=auto    # every drafter

`--speculative=auto` runs the batch through the serving engine with every drafter the model
supports (n-gram lookup, learned table, MTP when the checkpoint has the layer, the draft model
when there is one) and adaptive draft length; the engine picks each row's drafter every
iteration from that request's measured acceptance and the measured costs. Its `spec` object
adds `drafters`, `auto_choices` (the request's iterations per drafter) and `k_steps` (the
batch's iterations per block width).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags
from absl import logging

import engine
from engine.api import DEMO_CHECKPOINT, eagle3_checkpoint
from engine.runtime import compile_cache
from engine.runtime.speculative import drafters
from engine.service import mesh_flags

# The bundled demo model (checkpoints/demo, trained by checkpoints.train_demo).
DEMO_DRAFT = os.path.join(os.path.dirname(DEMO_CHECKPOINT), "draft")

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", DEMO_CHECKPOINT,
                    "Orbax (moejax) or Hugging Face checkpoint directory (default: the bundled "
                    "demo model).")
flags.DEFINE_multi_string("prompt", [], "Prompt text (repeat for a batch).")
flags.DEFINE_multi_string("prompt_ids", [], "Comma-separated prompt token ids (repeatable).")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "0 is greedy.", lower_bound=0.0)
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: off).", lower_bound=0)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).")
flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p * p(most likely) (0: off).")
flags.DEFINE_integer("seed", 0, "Sampling seed (row i uses seed + i).", lower_bound=0)
flags.DEFINE_multi_integer("stop_token_id", [], "Extra stop token ids (repeatable).")
flags.DEFINE_bool("ignore_eos", False, "Do not stop at EOS.")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "Parameter dtype (default: the "
                  "checkpoint's for Orbax, bfloat16 for Hugging Face).")
flags.DEFINE_bool("json", False, "Print JSON lines instead of text.")
flags.DEFINE_enum("speculative", drafters.OFF, [drafters.OFF, *drafters.names(), drafters.AUTO],
                  "Speculative decoding drafter: n-gram prompt lookup, the checkpoint's MTP "
                  "layer, a draft model (--draft_checkpoint), an n-gram table learned "
                  "across requests (--learned_table), or auto: all of those the model has, "
                  "chosen as it goes by the serving engine, with adaptive draft length.")
flags.DEFINE_integer("num_draft_tokens", 4, "Tokens drafted per step.", lower_bound=1)
flags.DEFINE_bool("adaptive_k", False, "Choose every step whether to draft (up to "
                  "--num_draft_tokens per row) or decode plainly, from a goodput model.")
flags.DEFINE_string("learned_table", None, "With --speculative=learned or auto: .npz table "
                    "loaded when it exists and saved after generating.")
flags.DEFINE_string("draft_checkpoint", None, "Draft model directory for --speculative=draft "
                    "or auto (default: the demo draft model when running the demo target).")
flags.DEFINE_string("eagle3_checkpoint", None, "EAGLE-3 head directory (config.json + "
                    "safetensors, as published) for --speculative=eagle3 or auto (default: "
                    "checkpoints/demo/eagle3 when running the demo target).")
flags.DEFINE_string("compilation_cache_dir", compile_cache.default_dir(),
                    "JAX persistent compilation cache: a second run loads, not recompiles ('' "
                    f"off; default ${compile_cache.ENV} or ~/.cache/moejax/jax_cache).")


def _parse_ids(s: str) -> list[int]:
  try:
    return [int(x) for x in s.replace(" ", "").split(",") if x]
  except ValueError:
    raise SystemExit(f"--prompt_ids must be comma-separated integers, got {s!r}")


def _speculative_config(model: "engine.LoadedModel") -> "engine.SpeculativeConfig | None":
  method = FLAGS.speculative
  if method == drafters.OFF:
    return None
  auto = method == drafters.AUTO
  draft = None
  if auto or drafters.drafter_class(method).uses_draft_model:
    path = FLAGS.draft_checkpoint
    if path is None and os.path.abspath(FLAGS.checkpoint) == os.path.abspath(DEMO_CHECKPOINT):
      path = DEMO_DRAFT
    if path is None and not auto:  # ("auto": the draft model is one drafter among others)
      raise ValueError(f"--speculative={method} needs --draft_checkpoint")
    draft = engine.load(path, dtype=model.params["embed"].dtype) if path else None
  # The learned table's memory: always for its own drafter, for "auto" when --learned_table
  # names a file (without it the table starts empty and is dropped).
  memory = (engine.NgramMemory.load_or_new(FLAGS.learned_table)
            if method == engine.NgramMemory.drafter or (auto and FLAGS.learned_table) else None)
  return engine.SpeculativeConfig(
      method, FLAGS.num_draft_tokens, draft.config if draft else None,
      draft.params if draft else None, memory=memory, adaptive=FLAGS.adaptive_k or auto,
      checkpoint=eagle3_checkpoint(method, FLAGS.eagle3_checkpoint, FLAGS.checkpoint))



def main(argv: list[str]) -> int:
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # hide JAX's backend-probing INFO lines
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  os.environ[compile_cache.ENV] = FLAGS.compilation_cache_dir  # read by engine.load
  if not os.path.isdir(FLAGS.checkpoint):
    raise SystemExit(f"error: checkpoint directory not found: {FLAGS.checkpoint}")
  if not FLAGS.prompt and not FLAGS.prompt_ids:
    raise SystemExit("give --prompt or --prompt_ids")
  prompts: list[str | list[int]] = list(FLAGS.prompt) + [_parse_ids(s) for s in FLAGS.prompt_ids]
  t0 = time.perf_counter()
  try:
    model = engine.load(FLAGS.checkpoint, dtype=FLAGS.dtype, mesh=mesh_flags.setup(),
                        kernels=mesh_flags.kernel_choice())
    speculative = _speculative_config(model)
    t1 = time.perf_counter()
    results = engine.generate(
        model, prompts, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
        top_k=FLAGS.top_k, top_p=FLAGS.top_p, min_p=FLAGS.min_p, seed=FLAGS.seed,
        stop_token_ids=FLAGS.stop_token_id, ignore_eos=FLAGS.ignore_eos,
        speculative=speculative)
  except (ValueError, FileNotFoundError, NotImplementedError) as e:
    # Bad input (checkpoint, prompt, sampling setting): one line, no traceback.
    raise SystemExit(f"error: {e}") from None
  t2 = time.perf_counter()
  for r in results:
    if FLAGS.json:
      line = {"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
              "prompt_tokens": r.prompt_tokens}
      if r.spec is not None:
        line["spec"] = r.spec
      print(json.dumps(line))
    else:
      print(r.text if model.tokenizer is not None else " ".join(map(str, r.token_ids)))
  n = sum(len(r.token_ids) for r in results)
  if speculative is not None and speculative.memory is not None and FLAGS.learned_table:
    speculative.memory.save(FLAGS.learned_table)
  if speculative is not None:
    steps = sum(r.spec["steps"] for r in results)
    accepted = sum(r.spec["accepted"] for r in results)
    drafted = sum(r.spec["drafted"] for r in results)
    per_step = sum(len(r.token_ids) - 1 for r in results) / max(steps, 1)  # prefill gave 1
    k = speculative.num_draft_tokens
    what = f"speculative={speculative.method} k={k}"
    if speculative.method == drafters.AUTO:  # every request's choices, summed
      totals: dict[str, int] = {}
      for r in results:
        for d, n_it in r.spec["auto_choices"].items():
          totals[d] = totals.get(d, 0) + n_it
      choices = ", ".join(f"{d} x{n_it}" for d, n_it in totals.items()) or "none"
      what = (f"speculative=auto k<={k} (drafters {','.join(results[0].spec['drafters'])}; "
              f"row iterations per drafter: {choices})")
    print(f"[moejax] {what}: {accepted}/{drafted} drafted tokens accepted, {per_step:.2f} "
          "tokens per target forward", file=sys.stderr)
  print(f"[moejax] {model.config.display_name}: load {t1 - t0:.1f}s, generate {n} tokens in "
        f"{t2 - t1:.1f}s (includes compilation)", file=sys.stderr)
  return 0
