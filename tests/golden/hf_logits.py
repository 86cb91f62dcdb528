"""Runs a Hugging Face checkpoint with transformers and saves its logits (reference side).

Runs in the separate Python 3.11 reference environment (torch + transformers; built by
`bash tests/golden/make_ref_env.sh`), never in the project's test environment:

    .venv-ref/bin/python tests/golden/hf_logits.py --model_dir=DIR --prompts=IN.npz \
        --out=OUT.npz

IN.npz holds int32 arrays `prompt_0`, `prompt_1`, ...; OUT.npz gets `logits_i` [L_i, V]
float32 (one batch-1 forward over each whole prompt, eager attention, float32) and
`greedy_i` [32] int32 (greedy continuation with `generate`, EOS disabled).
"""

import argparse

import numpy as np
import torch
import transformers


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--model_dir", required=True)
  ap.add_argument("--prompts", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--greedy_tokens", type=int, default=32)
  args = ap.parse_args()
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      args.model_dir, dtype=torch.float32, attn_implementation="eager")
  model.eval()
  model.generation_config.eos_token_id = None  # a fixed number of tokens, EOS or not
  prompts = np.load(args.prompts)
  out = {}
  with torch.no_grad():
    for key in sorted(prompts.files):
      i = key.split("_")[-1]
      ids = torch.as_tensor(prompts[key][None, :].astype(np.int64))
      out[f"logits_{i}"] = model(ids).logits[0].float().numpy()
      gen = model.generate(ids, do_sample=False, max_new_tokens=args.greedy_tokens,
                           eos_token_id=None, pad_token_id=0)
      out[f"greedy_{i}"] = gen[0, ids.shape[1]:].numpy().astype(np.int32)
  np.savez(args.out, **out)
  print(f"transformers {transformers.__version__}, torch {torch.__version__}: "
        f"{len(prompts.files)} prompts -> {args.out}")


if __name__ == "__main__":
  main()
