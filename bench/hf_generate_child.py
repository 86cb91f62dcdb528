"""transformers' side of `bench/vs_transformers.py`. Runs under the reference interpreter
(Python 3.11 with torch + transformers), never imports this project.

    python bench/hf_generate_child.py --model_dir=HF_DIR --jobs=jobs.json --out=out.json

`jobs.json` is a list of {"name", "prompts": [[ids]...], "max_new_tokens", "mode":
"plain"|"prompt_lookup"|"assistant", "num_draft_tokens", "assistant_dir", "repeats"}; each job
runs once to warm up, then `repeats` timed times. Output: per job the generated ids (of the
last run), the wall times, and this process's peak RSS.
"""

import argparse
import json
import resource
import time

import torch
from transformers import AutoModelForCausalLM


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model_dir", required=True)
  ap.add_argument("--jobs", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--threads", type=int, default=0)
  args = ap.parse_args()
  if args.threads:
    torch.set_num_threads(args.threads)
  model = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32)
  model.eval()
  assistants = {}
  with open(args.jobs) as fh:
    jobs = json.load(fh)
  results = []
  for job in jobs:
    prompts = job["prompts"]
    width = max(len(p) for p in prompts)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # Left padding, as transformers expects for batched generation with decoder-only models.
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=job["max_new_tokens"], min_new_tokens=job["max_new_tokens"],
                  do_sample=False, pad_token_id=pad, eos_token_id=None)
    if job["mode"] == "prompt_lookup":
      kwargs["prompt_lookup_num_tokens"] = job["num_draft_tokens"]
    elif job["mode"] == "assistant":
      path = job["assistant_dir"]
      if path not in assistants:
        assistants[path] = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
      kwargs["assistant_model"] = assistants[path]
      kwargs["num_assistant_tokens"] = job["num_draft_tokens"]
    times = []
    with torch.inference_mode():
      for i in range(job["repeats"] + 1):
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        if i:
          times.append(time.perf_counter() - t)
    new = out[:, width:].tolist()
    results.append(dict(name=job["name"], times=times, token_ids=new))
  with open(args.out, "w") as fh:
    json.dump(dict(results=results, peak_rss_mb=resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, torch_threads=torch.get_num_threads()), fh)


if __name__ == "__main__":
  main()
