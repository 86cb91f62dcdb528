"""Writes `checkpoints/demo/TRAINING.md` from the training runs' reports.

    python -m checkpoints.training_report [--demo_dir=checkpoints/demo] \
        [--hf_parity=checkpoints/demo/hf_parity.json]

Reads `target/train_report.json` and `draft/train_report.json` (written by `train_demo`) and
`split.json` (written by `demo_corpus`), fits the smoothed 4-gram baseline on the same split,
generates greedy completions of held-out function headers with the target, and records the
transformers parity check when its JSON (from `verify_hf_export`) is given.
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import app, flags

FLAGS = flags.FLAGS
N_SAMPLES = 6
SAMPLE_TOKENS = 64


def _json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as fh:
    return json.load(fh)


def heldout_headers(heldout_texts: list[str], n: int) -> list[str]:
  """`n` function headers spread over the held-out modules (deterministic)."""
  found = []
  for text in heldout_texts:
    found += [m.group(0) for m in re.finditer(r"^[ \t]*def \w+\([^\n]*\):[ \t]*$", text,
                                              flags=re.M)]
  step = max(len(found) // n, 1)
  return [found[i * step] for i in range(min(n, len(found)))]


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _row(name: str, rep: dict) -> str:
  h = rep["heldout"]
  return (f"| {name} | {rep['params']:,} | {rep['bytes_bf16'] / 1e6:.1f} MB | {rep['steps']} x "
          f"{rep['batch_size']} x {rep['seq_len']} = {rep['tokens_seen'] / 1e6:.2f} M | "
          f"{rep['train_seconds'] / 60:.1f} min | {rep['train_sample']['ce']:.3f} | "
          f"{h['ce']:.3f} |")


def eagle3_section(rep: dict | None) -> list[str]:
  """The EAGLE-3 head's section (`train_eagle3`'s report), or nothing without one."""
  if not rep:
    return []
  h = rep["heldout"]
  k = rep["ttt_steps"]
  agree = ", ".join(f"step {j}: {h[f'agree{j}']:.1%}" for j in range(k))
  ce = ", ".join(f"{h[f'ce{j}']:.3f}" for j in range(k))
  if "draft_vocab_coverage" in rep:
    vocab = (f"a reduced draft vocabulary of {rep['draft_vocab']:,} ids (`d2t` / `t2d`: the "
             f"training data's most frequent; they hold {rep['draft_vocab_coverage']:.2%} of "
             "the held-out sequences' generated tokens; over it the target's distribution is "
             "renormalised and positions whose target top-1 lies outside are left out)")
  else:
    vocab = "its own full-vocabulary `lm_head`"
  fast = ""
  if "precompute_seconds" in rep:
    fast = (f" The target's aux residual streams and final hidden state are computed once per "
            f"sequence ({rep['precompute_seconds'] / 60:.1f} min), so a step runs only the head "
            f"({rep['train_seconds'] / rep['steps']:.2f} s a step here, under load).")
    prof = rep.get("step_profile")
    if prof:
      fast += (f" One step of 8 x 128 tokens, timed side by side ({prof['note']}): the target "
               f"inside the step {prof['target_inside_s']} s, precomputed states "
               f"{prof['precomputed_s']} s, and with the {rep['draft_vocab']:,}-id draft "
               f"vocabulary {prof['precomputed_draft_vocab_s']} s.")
  return ["## EAGLE-3 head", "",
          f"`eagle3/` (`python -m checkpoints.train_eagle3`): an EAGLE-3 head in the published "
          f"MLA layout (`Eagle3DeepseekV2ForCausalLM`, `midlayer.*`, bf16), {rep['params']:,} "
          f"parameters ({vocab}; the target's embedding, not shipped), aux layer ids "
          f"{rep['aux_layer_ids']} (input convention: the residual streams entering layers 2 "
          f"and 3 and the 4th layer's output). Data: {rep['sequences']:,} prompts of "
          f"{rep['prompt_len']} tokens from the train split, each continued "
          f"{rep['new_tokens']} tokens by the target (float32; "
          + ("greedy" if rep.get("greedy_only") else "half greedy, half sampled at temperature 1")
          + f"), {rep['generate_seconds'] / 60:.1f} min. Training-time test with "
          f"K = {k} unrolled steps, soft cross-entropy against the target's distribution, step "
          f"weights {rep['decay']}^k; AdamW, peak lr {rep['lr']}, {rep['steps']} steps x "
          f"{rep['batch']} sequences, {rep['train_seconds'] / 60:.1f} min on this shared 2-core "
          f"CPU.{fast} On 16 generated sequences never trained on, the head's top-1 agrees with "
          f"the target's ({agree}; cross-entropy {ce}).{_acceptance(rep.get('acceptance'))}",
          ""] + _eagle3_phases(rep.get("earlier_phases", []), "draft_vocab_coverage" in rep)


def _acceptance(acc: dict | None) -> str:
  """The measured acceptance against the MTP layer (`acceptance` in the report, written after
  measuring: `bench.speculative` rows and `engine.generate --json`)."""
  if not acc:
    return " Acceptance against the MTP layer: BENCHMARKS.md, issue 55."
  cells = "; ".join(f"{w}: {r['eagle3'][0]:.2f} ({'/'.join(f'{x:.2f}' for x in r['eagle3'][1])}) "
                    f"against {r['mtp'][0]:.2f} ({'/'.join(f'{x:.2f}' for x in r['mtp'][1])})"
                    for w, r in acc["rows"].items())
  return (f" Mean accepted length at K = 3 (greedy, float32; acceptance at draft 1/2/3 in "
          f"brackets), the head against the MTP layer, `{acc['command']}`: {cells}.")


def _eagle3_phases(earlier: list[dict], cut: bool = False) -> list[str]:
  """The phases the head trained in before the one above, each from the previous one's weights
  with a fresh AdamW state and schedule."""
  if not earlier:
    return []
  out = ["Phases, each from the previous one's weights with a fresh AdamW state and warm-up + "
         "cosine schedule (the target's forward inside every step before the last):", ""]
  for i, p in enumerate(earlier, 1):
    start = "random weights (its `lm_head` the target's)" if i == 1 else f"phase {i - 1}"
    data = "greedy" if p.get("greedy_only") else "half greedy, half sampled"
    held = p.get("heldout", {})
    out.append(f"{i}. from {start}: {p['sequences']} continuations ({data}), {p['steps']} "
               f"steps x {p['batch']}, peak lr {p['lr']}, {p['train_seconds'] / 60:.1f} min"
               + (f"; held-out top-1 agreement {held['agree0']:.1%} / {held['agree1']:.1%} / "
                  f"{held['agree2']:.1%}" if held else "") + ".")
  return out + [f"{len(earlier) + 1}. from phase {len(earlier)}"
                + (" (its `lm_head` cut to the draft vocabulary's rows)" if cut else "")
                + ": the numbers above.", ""]


def build(demo_dir: str, hf_parity_path: str | None) -> str:
  import engine
  from checkpoints import demo_corpus, ngram_baseline

  target, draft = (_json(os.path.join(demo_dir, m, "train_report.json"))
                   for m in ("target", "draft"))
  split = _json(os.path.join(demo_dir, "split.json")) or {}
  tok_path = os.path.join(demo_dir, "tokenizer.json")
  tokenizer = demo_corpus.load_tokenizer(tok_path)
  train_files, heldout_files = demo_corpus.split(demo_corpus.stdlib_files())
  train_ids, heldout_ids = demo_corpus.tokenized_corpus(demo_corpus.default_cache_dir(), tokenizer,
                                                        train_files, heldout_files)
  ngram = ngram_baseline.evaluate(train_ids, heldout_ids, n=4, vocab_size=tokenizer.get_vocab_size())

  lines = ["# Bundled demo models: training report", "",
           "Written by `python -m checkpoints.training_report` from the training runs' "
           "reports; rerun it after retraining.", "",
           "## Corpus and split", "",
           f"The `.py` files of the Python {sys.version.split()[0]} standard library (the "
           "interpreter running the scripts), without the regression test suites, generated "
           "data tables and site-packages (`checkpoints/demo_corpus.py` lists why). Split by "
           "top-level module with `crc32(module) % 100 < 5` to held-out; `split.json` lists both "
           "sides.", "",
           "| side | modules | files | MB | tokens |", "|---|---|---|---|---|"]
  for side in ("train", "heldout"):
    s = split.get(side, {})
    lines.append(f"| {side} | {len(s.get('modules', []))} | {s.get('files', '?')} | "
                 f"{s.get('bytes', 0) / 1e6:.2f} | {s.get('tokens', 0):,} |")
  lines += ["", f"Held-out modules: {', '.join(split.get('heldout', {}).get('modules', []))}.",
            "", "Tokenizer: byte-level BPE trained with `tokenizers` on the train side, "
            f"{tokenizer.get_vocab_size()} tokens, `<|pad|>`=0, `<|bos|>`=1, `<|eos|>`=2; each "
            "file is framed BOS ... EOS.", "",
            "## Models and training", "",
            "| model | params | bf16 | steps x batch x length = tokens | wall time | train CE | "
            "held-out CE |", "|---|---|---|---|---|---|---|"]
  for name, rep in (("target (DeepSeek-V3 arch, MoE + MTP)", target),
                    ("draft (dense Llama)", draft)):
    if rep:
      lines.append(_row(name, rep))
  lines += [f"| smoothed 4-gram (interpolated modified Kneser-Ney) | | | train split | "
            f"{ngram['fit_s']:.1f} s | | {ngram['nats_per_token']:.3f} |", "",
            "Cross-entropies are nats per token on the same tokenization, over every token after "
            "a BOS of non-overlapping windows covering the held-out split (train CE: as many "
            "windows from the train split). Training: AdamW (b2 0.95, weight decay 0.1 on "
            "matrices), warm-up then cosine decay, float32 on this 2-core CPU, the engine's own "
            "forward pass; DeepSeek's auxiliary-loss-free expert balancing; MTP loss weight "
            f"{target['mtp_weight'] if target else '?'}.", ""]
  for name, rep in (("target", target), ("draft", draft)):
    if rep and rep.get("phases"):
      desc = "; ".join(
          f"phase {i + 1}: {ph['steps']} steps, peak lr {ph['lr']}, batch seed {ph['seed']}"
          + (f", from the phase-{i} weights" if ph.get("init_from") else "")
          for i, ph in enumerate(rep["phases"]))
      lines += [f"The {name} trained in phases, each a fresh AdamW state and warm-up + cosine "
                f"schedule started from the previous phase's weights ({desc}).", ""]
  if target and "mtp_agree" in target["heldout"]:
    h = target["heldout"]
    lines += ["## MTP head", "",
              f"On held-out text the MTP layer's top-1 prediction of token i+2 agrees with the "
              f"target's own top-1 prediction of that token {h['mtp_agree']:.1%} of the time "
              f"(matches the true token {h['mtp_acc']:.1%}; MTP cross-entropy "
              f"{h['mtp_ce']:.3f}).", ""]
  lines += eagle3_section(_json(os.path.join(demo_dir, "eagle3", "train_report.json")))
  parity = _json(hf_parity_path) if hf_parity_path else None
  if parity:
    errs = [p["rel_err"] for p in parity["prompts"]]
    same = all(p["greedy_identical"] for p in parity["prompts"])
    lines += ["## Same weights in transformers", "",
              "`python -m checkpoints.verify_hf_export` exports the target to Hugging Face "
              "safetensors and runs it with `DeepseekV3ForCausalLM` in the Python 3.11 reference "
              f"environment ({parity['reference'].split(':')[0]}): max relative logit error "
              f"{max(errs):.1e} over {len(errs)} held-out prompts of "
              f"{parity['prompts'][0]['prompt_tokens']} tokens (float32); 32 greedy tokens "
              f"{'identical' if same else 'NOT identical'}.", ""]
  model = engine.load(os.path.join(demo_dir, "target"), progress=False)
  texts = demo_corpus.read_texts(heldout_files)
  lines += ["## Greedy completions of held-out function headers", "",
            f"Prompt: BOS + the header line; {SAMPLE_TOKENS} new tokens, greedy "
            "(bfloat16 weights, as shipped).", ""]
  for header in heldout_headers(texts, N_SAMPLES):
    # No trailing newline: BPE merges "\n" with the next indentation, so a prompt ending in a
    # bare newline is a tokenization the model never saw. The tokenizer prepends BOS.
    prompt = model.encode(header)
    out = engine.generate(model, prompt, max_new_tokens=SAMPLE_TOKENS)
    lines += ["```python", header + out.text.rstrip(), "```", ""]
  sizes = {m: _dir_bytes(os.path.join(demo_dir, m)) for m in ("target", "draft", "eagle3")
           if os.path.isdir(os.path.join(demo_dir, m))}
  lines += ["## Shipped files", "",
            f"`checkpoints/demo/`: target {sizes['target'] / 1e6:.1f} MB, draft "
            f"{sizes['draft'] / 1e6:.1f} MB"
            + (f", EAGLE-3 head {sizes['eagle3'] / 1e6:.1f} MB" if "eagle3" in sizes else "")
            + ", tokenizer and split "
            f"{(_dir_bytes(demo_dir) - sum(sizes.values())) / 1e6:.2f} MB; total "
            f"{_dir_bytes(demo_dir) / 1e6:.1f} MB.", ""]
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  text = build(FLAGS.demo_dir, FLAGS.hf_parity)
  with open(os.path.join(FLAGS.demo_dir, "TRAINING.md"), "w") as fh:
    fh.write(text)
  print(text)


if __name__ == "__main__":
  flags.DEFINE_string("demo_dir", "checkpoints/demo", "The demo checkpoints folder.")
  flags.DEFINE_string("hf_parity", "checkpoints/demo/hf_parity.json",
                      "verify_hf_export's JSON output (optional).")
  app.run(main)
