"""Serving benchmark over gRPC (the shape of `vllm bench serve`).

    python -m engine.bench --num_prompts=64 --concurrency=8 --dataset=random
    python -m engine.bench --dataset=shared_prefix --request_rate=4 --json_out=bench.json
    python -m engine.bench --dataset=multi_turn --num_turns=3 --concurrency=4

Requests arrive as a Poisson process (`--request_rate` per second; inf sends at once), at most
`--concurrency` in flight. Datasets are token ids drawn from the model's vocabulary (from
GetModelInfo): `random` (independent prompts), `shared_prefix` (a few system-prompt-like
prefixes shared by many requests), `multi_turn` (conversations whose next prompt is the
previous prompt + answer + a new user turn, sent in order, so the prefix cache carries them).

Reports completed/failed, requests/s, input and output tokens/s, TTFT, TPOT ((E2E - TTFT) /
(output tokens - 1)), ITL (gaps between streamed chunks; a chunk may carry several tokens when
the engine runs several decode steps on the device) and E2EL as mean/p50/p90/p99/max in ms,
and the prefix cache hit rate (cached / prompt tokens), as a table and as JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import time
from typing import Any, Sequence

import grpc
import numpy as np
from absl import flags

from engine.service.client import AsyncInferenceClient, Completion, build_request

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "127.0.0.1:50051", "Server address HOST:PORT.")
flags.DEFINE_string("api_key", None, "API key (default: $MOEJAX_API_KEY).")
flags.DEFINE_integer("num_prompts", 64, "Requests in total (all turns counted).", lower_bound=1)
flags.DEFINE_integer("concurrency", 8, "Most requests (conversations) in flight.", lower_bound=1)
flags.DEFINE_float("request_rate", math.inf, "Poisson arrival rate per second (inf: all at "
                   "once).")
flags.DEFINE_integer("seed", 0, "Dataset and arrival seed.")
flags.DEFINE_enum("dataset", "random", ["random", "shared_prefix", "multi_turn"], "Workload.")
flags.DEFINE_integer("input_len", 64, "Mean prompt tokens (new tokens per turn for multi_turn).")
flags.DEFINE_integer("output_len", 32, "Mean tokens generated per request.")
flags.DEFINE_float("range_ratio", 0.5, "Lengths are uniform in len * [1 - r, 1 + r].")
flags.DEFINE_integer("prefix_len", 64, "shared_prefix: tokens of each shared prefix.")
flags.DEFINE_integer("num_prefixes", 4, "shared_prefix: distinct prefixes.")
flags.DEFINE_integer("num_turns", 3, "multi_turn: turns per conversation.")
flags.DEFINE_string("json_out", None, "Also write the results here.")

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class Conversation:
  """Requests sent in order; with `follow_up`, each turn extends the previous prompt + answer."""
  turns: list[list[int]]  # prompt ids of the first turn, then the new tokens of each turn
  output_lens: list[int]
  follow_up: bool = False


@dataclasses.dataclass
class RequestResult:
  ok: bool
  error: str = ""
  prompt_tokens: int = 0
  cached_tokens: int = 0
  output_tokens: int = 0
  ttft_s: float = 0.0
  e2el_s: float = 0.0
  itl_s: list[float] = dataclasses.field(default_factory=list)


def _length(rng: random.Random, mean: int, ratio: float) -> int:
  return max(1, rng.randint(int(mean * (1 - ratio)), max(int(mean * (1 + ratio)), 1)))


def make_dataset(name: str, num_prompts: int, vocab_size: int, max_model_len: int,
                 input_len: int, output_len: int, range_ratio: float = 0.5,
                 prefix_len: int = 64, num_prefixes: int = 4, num_turns: int = 3,
                 seed: int = 0) -> list[Conversation]:
  """Token-id workloads; ids avoid the low (special) ids of most vocabularies."""
  rng = random.Random(seed)
  lo = min(16, vocab_size - 1)

  def ids(n: int) -> list[int]:
    return [rng.randrange(lo, vocab_size) for _ in range(n)]

  def out_len() -> int:
    return _length(rng, output_len, range_ratio)

  if name == "random":
    return [Conversation([ids(_length(rng, input_len, range_ratio))], [out_len()])
            for _ in range(num_prompts)]
  if name == "shared_prefix":
    prefixes = [ids(prefix_len) for _ in range(num_prefixes)]
    return [Conversation([prefixes[i % num_prefixes] + ids(_length(rng, input_len,
                                                                    range_ratio))],
                         [out_len()]) for i in range(num_prompts)]
  if name == "multi_turn":
    convs = []
    for start in range(0, num_prompts, num_turns):
      n = min(num_turns, num_prompts - start)
      turns = [ids(_length(rng, input_len, range_ratio)) for _ in range(n)]
      outs = [out_len() for _ in range(n)]
      total = sum(map(len, turns)) + sum(outs)
      if total > max_model_len:  # shrink to fit the context: new tokens and answers
        scale = max_model_len / total
        turns = [t[:max(1, int(len(t) * scale))] for t in turns]
        outs = [max(1, int(o * scale)) for o in outs]
      convs.append(Conversation(turns, outs, follow_up=True))
    return convs
  raise ValueError(f"dataset: unknown {name!r}")


async def _send(client: AsyncInferenceClient, prompt: list[int], max_tokens: int,
                results: list[RequestResult]) -> Completion | None:
  done = Completion(sent_at=time.perf_counter())
  try:
    async for chunk in client.stream(build_request(prompt, max_tokens=max_tokens,
                                                   ignore_eos=True)):
      done.add(chunk)
  except grpc.aio.AioRpcError as e:
    results.append(RequestResult(ok=False, error=e.code().name))
    return None
  times = done.chunk_times
  first_token = next((t for t, n in zip(times, done.chunk_tokens) if n), times[-1])
  token_times = [t for t, n in zip(times, done.chunk_tokens) if n]
  results.append(RequestResult(
      ok=True, prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens,
      output_tokens=len(done.token_ids), ttft_s=first_token - done.sent_at,
      e2el_s=times[-1] - done.sent_at, itl_s=list(np.diff(token_times))))
  return done


async def run_benchmark(target: str, conversations: Sequence[Conversation], concurrency: int,
                        request_rate: float = math.inf, seed: int = 0,
                        api_key: str | None = None) -> tuple[list[RequestResult], float]:
  """Sends every conversation; returns (per-request results, wall seconds)."""
  rng = random.Random(seed + 1)
  results: list[RequestResult] = []
  limit = asyncio.Semaphore(concurrency)
  async with AsyncInferenceClient(target, api_key=api_key) as client:
    async def converse(conv: Conversation) -> None:
      async with limit:
        context: list[int] = []
        for new_tokens, max_tokens in zip(conv.turns, conv.output_lens):
          prompt = context + new_tokens if conv.follow_up else new_tokens
          done = await _send(client, prompt, max_tokens, results)
          if done is None:
            return
          context = prompt + done.token_ids

    t0 = time.perf_counter()
    tasks = []
    for conv in conversations:
      tasks.append(asyncio.create_task(converse(conv)))
      if math.isfinite(request_rate) and request_rate > 0:
        await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def _dist_ms(values: Sequence[float]) -> dict[str, float]:
  if not len(values):
    return dict(mean=0.0, **{f"p{p}": 0.0 for p in PERCENTILES}, max=0.0)
  ms = np.asarray(values, np.float64) * 1e3
  return dict(mean=float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p))
                                        for p in PERCENTILES}, max=float(ms.max()))


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
  ok = [r for r in results if r.ok]
  errors: dict[str, int] = {}
  for r in results:
    if not r.ok:
      errors[r.error] = errors.get(r.error, 0) + 1
  prompt = sum(r.prompt_tokens for r in ok)
  output = sum(r.output_tokens for r in ok)
  return dict(
      completed=len(ok), failed=len(results) - len(ok), errors=errors,
      duration_s=duration_s, request_throughput=len(ok) / duration_s,
      input_tokens=prompt, output_tokens=output,
      input_throughput=prompt / duration_s, output_throughput=output / duration_s,
      prefix_cache_hit_rate=sum(r.cached_tokens for r in ok) / max(prompt, 1),
      ttft_ms=_dist_ms([r.ttft_s for r in ok]),
      tpot_ms=_dist_ms([(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
                        if r.output_tokens > 1]),
      itl_ms=_dist_ms([g for r in ok for g in r.itl_s]),
      e2el_ms=_dist_ms([r.e2el_s for r in ok]))


def format_table(summary: dict[str, Any]) -> str:
  lines = [f"{'completed / failed':<28}{summary['completed']} / {summary['failed']} "
           f"{summary['errors'] or ''}",
           f"{'duration (s)':<28}{summary['duration_s']:.2f}",
           f"{'requests/s':<28}{summary['request_throughput']:.2f}",
           f"{'input tokens/s':<28}{summary['input_throughput']:.1f}",
           f"{'output tokens/s':<28}{summary['output_throughput']:.1f}",
           f"{'prefix cache hit rate':<28}{summary['prefix_cache_hit_rate']:.1%}",
           f"{'(ms)':<10}" + "".join(f"{k:>10}" for k in ("mean", "p50", "p90", "p99", "max"))]
  for name in ("ttft", "tpot", "itl", "e2el"):
    d = summary[f"{name}_ms"]
    lines.append(f"{name.upper():<10}" + "".join(f"{d[k]:>10.1f}" for k in
                                                 ("mean", "p50", "p90", "p99", "max")))
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  from engine.service.client import InferenceClient
  api_key = FLAGS.api_key or os.environ.get("MOEJAX_API_KEY")
  try:
    with InferenceClient(FLAGS.target, api_key=api_key, timeout=30) as client:
      info = client.model_info()
  except grpc.RpcError as e:
    raise SystemExit(f"error: {FLAGS.target}: {e.code().name}: {e.details()}")
  room = info.max_model_len - FLAGS.output_len * 2
  input_len = min(FLAGS.input_len, max(1, room // 2))
  prefix_len = min(FLAGS.prefix_len, max(1, room - 2 * input_len))
  convs = make_dataset(FLAGS.dataset, FLAGS.num_prompts, info.vocab_size, info.max_model_len,
                       input_len, FLAGS.output_len, FLAGS.range_ratio, prefix_len,
                       FLAGS.num_prefixes, FLAGS.num_turns, FLAGS.seed)
  results, duration = asyncio.run(run_benchmark(FLAGS.target, convs, FLAGS.concurrency,
                                                FLAGS.request_rate, FLAGS.seed, api_key))
  summary = summarize(results, duration)
  summary["config"] = dict(target=FLAGS.target, model=info.model_name, dataset=FLAGS.dataset,
                           num_prompts=FLAGS.num_prompts, concurrency=FLAGS.concurrency,
                           request_rate=str(FLAGS.request_rate), seed=FLAGS.seed,
                           input_len=input_len, output_len=FLAGS.output_len)
  print(f"moejax serving benchmark: {FLAGS.dataset}, {FLAGS.num_prompts} requests, "
        f"concurrency {FLAGS.concurrency}, rate {FLAGS.request_rate}/s against {FLAGS.target}")
  print(format_table(summary))
  print(json.dumps(summary))  # the last line: machine-readable
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as fh:
      json.dump(summary, fh, indent=1)
  return 0 if summary["failed"] == 0 else 1
