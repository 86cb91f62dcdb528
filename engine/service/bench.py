"""Serving benchmark over gRPC or the OpenAI HTTP API (the shape of `vllm bench serve`).

    python -m engine.bench --num_prompts=64 --concurrency=8 --dataset=random
    python -m engine.bench --dataset=shared_prefix --request_rate=4 --json_out=bench.json
    python -m engine.bench --dataset=multi_turn --num_turns=3 --concurrency=4
    python -m engine.bench --backend=openai --base_url=http://127.0.0.1:8000/v1 --dataset=agent
    python -m engine.bench --dataset=image --image_size=448x448 --images_per_request=2

Requests arrive as a Poisson process (`--request_rate` per second; inf sends at once), at most
`--concurrency` in flight. Datasets are token ids drawn from the model's vocabulary (from
GetModelInfo): `random` (independent prompts), `shared_prefix` (a few system-prompt-like
prefixes shared by many requests), `multi_turn` (conversations whose next prompt is the
previous prompt + answer + a new user turn, sent in order, so the prefix cache carries them),
and, as chat requests, `agent`: multi-turn tool use, every conversation opening with the same
long system prompt and tools; each turn the assistant calls a tool (the call the server parsed
from the reply, else one in the conversation's script, since a model without tool calling
never makes one), the tool's result comes back, the next turn extends the conversation (a
growing prefix shared by all turns, and the system prompt by all conversations), and `image`:
chat requests of `--images_per_request` synthetic PNGs of `--image_size` each
(`--image_repeat` resends earlier requests: encoder-cache and prefix-cache hits); over gRPC
the TTFT is split into the server's image encoding time and the rest (queue and prefill).
`--backend=grpc` (`Generate`, `Chat`) or `openai` (`/v1/completions` with token-id prompts,
`/v1/chat/completions`, through the `openai` package; `--base_url`).

Reports completed/failed, requests/s, input and output tokens/s, TTFT, TPOT ((E2E - TTFT) /
(output tokens - 1)), ITL (gaps between streamed chunks; a chunk may carry several tokens when
the engine runs several decode steps on the device) and E2EL as mean/p50/p90/p99/max in ms,
the prefix cache hit rate (cached / prompt tokens) and, for chat, the tool-call parse success
(parsed calls that name a declared tool with JSON-object arguments / parsed calls; n/a when the
model made none), as a table and as JSON.
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

from engine.service.bench_backends import GrpcBackend, OpenAIBackend, Sample, valid_call

FLAGS = flags.FLAGS
flags.DEFINE_enum("backend", "grpc", ["grpc", "openai"], "API to drive.")
flags.DEFINE_string("target", "127.0.0.1:50051", "gRPC server address HOST:PORT.")
flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "--backend=openai: the API's URL.")
flags.DEFINE_string("model", None, "--backend=openai: model name (default: the first listed).")
flags.DEFINE_string("api_key", None, "API key (default: $MOEJAX_API_KEY).")
flags.DEFINE_integer("num_prompts", 64, "Requests in total (all turns counted).", lower_bound=1)
flags.DEFINE_integer("concurrency", 8, "Most requests (conversations) in flight.", lower_bound=1)
flags.DEFINE_float("request_rate", math.inf, "Poisson arrival rate per second (inf: all at "
                   "once).")
flags.DEFINE_integer("seed", 0, "Dataset and arrival seed.")
flags.DEFINE_enum("dataset", "random", ["random", "shared_prefix", "multi_turn", "agent",
                                        "image"], "Workload.")
flags.DEFINE_integer("input_len", 64, "Mean prompt tokens (new tokens per turn for multi_turn).")
flags.DEFINE_integer("output_len", 32, "Mean tokens generated per request.")
flags.DEFINE_float("range_ratio", 0.5, "Lengths are uniform in len * [1 - r, 1 + r].")
flags.DEFINE_integer("prefix_len", 64, "shared_prefix: tokens of each shared prefix.")
flags.DEFINE_integer("num_prefixes", 4, "shared_prefix: distinct prefixes.")
flags.DEFINE_integer("num_turns", 3, "multi_turn, agent: turns per conversation.")
flags.DEFINE_bool("agent_tools", True, "agent: declare the tools in the request (off for "
                  "models whose template has no tool calling, such as the demo's).")
flags.DEFINE_string("image_size", "448x448", "image: WIDTHxHEIGHT (or one number) of each "
                    "synthetic image.")
flags.DEFINE_integer("images_per_request", 1, "image: images in each chat request.",
                     lower_bound=1)
flags.DEFINE_float("image_repeat", 0.0, "image: fraction of requests that resend an earlier "
                   "request's images and text (encoder and prefix cache hits).", lower_bound=0,
                   upper_bound=1)
flags.DEFINE_string("json_out", None, "Also write the results here.")

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class Conversation:
  """Requests sent in order; with `follow_up`, each turn extends the previous prompt + answer."""
  turns: list[list[int]]  # prompt ids of the first turn, then the new tokens of each turn
  output_lens: list[int]
  follow_up: bool = False


RequestResult = Sample  # one request's outcome (bench_backends)


@dataclasses.dataclass
class ImageChat:
  """One chat request: a user message with images (data: URLs) and a short question."""
  messages: list[dict]
  output_len: int


def synthetic_image(width: int, height: int, rng: np.random.Generator) -> bytes:
  """A PNG of smooth random colour fields (noise would make every file its maximum size)."""
  from PIL import Image
  import io
  coarse = rng.integers(0, 256, (max(1, height // 32), max(1, width // 32), 3), np.uint8)
  img = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
  buf = io.BytesIO()
  img.save(buf, format="PNG")
  return buf.getvalue()


def make_image_dataset(num_prompts: int, width: int, height: int, images_per_request: int,
                       output_len: int, repeat: float = 0.0, range_ratio: float = 0.5,
                       seed: int = 0) -> list[ImageChat]:
  """Chat requests of `images_per_request` synthetic images each; a `repeat` fraction sends
  an earlier request's images and text again (its encoder outputs and KV pages are cached)."""
  import base64
  rng, nrng = random.Random(seed), np.random.default_rng(seed)
  out: list[ImageChat] = []
  for i in range(num_prompts):
    if out and rng.random() < repeat:
      out.append(ImageChat(rng.choice(out).messages, _length(rng, output_len, range_ratio)))
      continue
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.
                                                  b64encode(synthetic_image(width, height,
                                                                            nrng)).decode()}}
             for _ in range(images_per_request)]
    parts.append({"type": "text", "text": f"Describe image set {i} in one line."})
    out.append(ImageChat([{"role": "user", "content": parts}],
                         _length(rng, output_len, range_ratio)))
  return out


def parse_size(text: str) -> tuple[int, int]:
  w, _, h = text.lower().partition("x")
  return int(w), int(h or w)


@dataclasses.dataclass
class AgentConversation:
  """A scripted tool-using conversation: the shared system prompt, a task, tool results."""
  system: str
  task: str
  tool_results: list[str]
  output_lens: list[int]


AGENT_TOOLS = [
    {"type": "function", "function": {"name": "run_python", "description": "Run Python code",
     "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                    "required": ["code"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"]}}}]
_WORDS = ("def return import self value path file config data result list dict key "
          "open read write line name test error raise class with for in if else None "
          "True False args kwargs print format json os sys time").split()


def make_agent_dataset(num_prompts: int, num_turns: int, system_words: int, input_words: int,
                       output_len: int, range_ratio: float = 0.5, seed: int = 0
                       ) -> list[AgentConversation]:
  """Conversations of `num_turns` chat requests each (num_prompts requests in all)."""
  rng = random.Random(seed)

  def words(n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))

  system = "You are a coding agent. Use the tools. " + words(system_words)
  convs = []
  for start in range(0, num_prompts, num_turns):
    n = min(num_turns, num_prompts - start)
    convs.append(AgentConversation(
        system, "Task: " + words(_length(rng, input_words, range_ratio)),
        [words(_length(rng, input_words, range_ratio)) for _ in range(n - 1)],
        [_length(rng, output_len, range_ratio) for _ in range(n)]))
  return convs


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


def backend_for(backend: str, target: str, api_key: str | None, model: str | None) -> Any:
  if backend == "openai":
    return OpenAIBackend(target, api_key, model)
  return GrpcBackend(target, api_key)


async def run_benchmark(target: str, conversations: Sequence[Any], concurrency: int,
                        request_rate: float = math.inf, seed: int = 0,
                        api_key: str | None = None, backend: str = "grpc",
                        model: str | None = None, agent_tools: bool = True
                        ) -> tuple[list[Sample], float]:
  """Sends every conversation (`target`: HOST:PORT for grpc, the base URL for openai);
  returns (per-request results, wall seconds)."""
  rng = random.Random(seed + 1)
  results: list[Sample] = []
  limit = asyncio.Semaphore(concurrency)
  async with backend_for(backend, target, api_key, model) as client:
    async def converse(conv: Conversation) -> None:
      context: list[int] = []
      for new_tokens, max_tokens in zip(conv.turns, conv.output_lens):
        prompt = context + new_tokens if conv.follow_up else new_tokens
        done = await client.complete(prompt, max_tokens)
        results.append(done)
        if not done.ok:
          return
        context = prompt + done.token_ids

    async def act(conv: AgentConversation) -> None:
      messages = [{"role": "system", "content": conv.system},
                  {"role": "user", "content": conv.task}]
      tools = AGENT_TOOLS if agent_tools else None
      for turn, max_tokens in enumerate(conv.output_lens):
        done = await client.chat(messages, tools, max_tokens)
        results.append(done)
        if not done.ok or turn == len(conv.tool_results):
          return
        calls = done.tool_calls or [{"id": f"call_{turn}", "type": "function", "function": {
            "name": "run_python", "arguments": json.dumps({"code": f"step({turn})"})}}]
        messages.append({"role": "assistant", "content": done.text or None,
                         "tool_calls": calls})
        messages.extend({"role": "tool", "tool_call_id": c["id"],
                         "content": conv.tool_results[turn]} for c in calls)

    async def ask(conv: ImageChat) -> None:
      results.append(await client.chat(conv.messages, None, conv.output_len))

    async def one(conv: Any) -> None:
      async with limit:
        if isinstance(conv, ImageChat):
          await ask(conv)
        else:
          await (act(conv) if isinstance(conv, AgentConversation) else converse(conv))

    t0 = time.perf_counter()
    tasks = []
    for conv in conversations:
      tasks.append(asyncio.create_task(one(conv)))
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


def summarize(results: Sequence[Sample], duration_s: float,
              tool_names: Sequence[str] = tuple(t["function"]["name"] for t in AGENT_TOOLS)
              ) -> dict[str, Any]:
  ok = [r for r in results if r.ok]
  calls = [c for r in ok for c in r.tool_calls]
  errors: dict[str, int] = {}
  for r in results:
    if not r.ok:
      errors[r.error] = errors.get(r.error, 0) + 1
  prompt = sum(r.prompt_tokens for r in ok)
  output = sum(r.output_tokens for r in ok)
  # TTFT split (gRPC reports the server's encode time): encode, and the rest (queue+prefill).
  split = [r for r in ok if r.encode_s is not None]
  ttft_split = None if not split else dict(
      encode_ms=_dist_ms([r.encode_s for r in split]),
      prefill_ms=_dist_ms([max(0.0, r.ttft_s - r.encode_s) for r in split]),
      encode_share=sum(r.encode_s for r in split) / max(sum(r.ttft_s for r in split), 1e-9))
  return dict(ttft_split=ttft_split,
      completed=len(ok), failed=len(results) - len(ok), errors=errors,
      duration_s=duration_s, request_throughput=len(ok) / duration_s,
      input_tokens=prompt, output_tokens=output,
      input_throughput=prompt / duration_s, output_throughput=output / duration_s,
      prefix_cache_hit_rate=sum(r.cached_tokens for r in ok) / max(prompt, 1),
      ttft_ms=_dist_ms([r.ttft_s for r in ok]),
      tpot_ms=_dist_ms([(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
                        if r.output_tokens > 1]),
      itl_ms=_dist_ms([g for r in ok for g in r.itl_s]),
      e2el_ms=_dist_ms([r.e2el_s for r in ok]),
      tool_calls=sum(len(r.tool_calls) for r in ok),
      tool_call_parse_success=(None if not calls else sum(
          valid_call(c, tool_names) for c in calls) / len(calls)))


def format_table(summary: dict[str, Any]) -> str:
  lines = [f"{'completed / failed':<28}{summary['completed']} / {summary['failed']} "
           f"{summary['errors'] or ''}",
           f"{'duration (s)':<28}{summary['duration_s']:.2f}",
           f"{'requests/s':<28}{summary['request_throughput']:.2f}",
           f"{'input tokens/s':<28}{summary['input_throughput']:.1f}",
           f"{'output tokens/s':<28}{summary['output_throughput']:.1f}",
           f"{'prefix cache hit rate':<28}{summary['prefix_cache_hit_rate']:.1%}",
           f"{'tool calls (parse success)':<28}{summary['tool_calls']} ("
           + ("n/a" if summary["tool_call_parse_success"] is None
              else f"{summary['tool_call_parse_success']:.1%}") + ")",
           f"{'(ms)':<10}" + "".join(f"{k:>10}" for k in ("mean", "p50", "p90", "p99", "max"))]
  rows = [(name.upper(), summary[f"{name}_ms"]) for name in ("ttft", "tpot", "itl", "e2el")]
  split = summary.get("ttft_split")
  if split and split["encode_ms"]["max"] > 0:
    rows[1:1] = [(" encode", split["encode_ms"]), (" prefill", split["prefill_ms"])]
  for name, d in rows:
    lines.append(f"{name:<10}" + "".join(f"{d[k]:>10.1f}" for k in
                                         ("mean", "p50", "p90", "p99", "max")))
  if split and split["encode_ms"]["max"] > 0:
    lines.append(f"{'encode share of TTFT':<28}{split['encode_share']:.1%}")
  return "\n".join(lines)


def _server_limits(api_key: str | None) -> tuple[str, int, int]:
  """(model name, vocabulary size or 0, context length) from the server being measured."""
  if FLAGS.backend == "openai":
    import urllib.request
    req = urllib.request.Request(FLAGS.base_url.rstrip("/") + "/models",
                                 headers={"authorization": f"Bearer {api_key or 'none'}"})
    try:
      with urllib.request.urlopen(req, timeout=30) as resp:
        card = json.load(resp)["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
      raise SystemExit(f"error: {FLAGS.base_url}/models: {e}")
    return (FLAGS.model or card["id"], int(card.get("vocab_size") or 0),
            int(card.get("max_model_len") or 4096))
  from engine.service.client import InferenceClient
  try:
    with InferenceClient(FLAGS.target, api_key=api_key, timeout=30) as client:
      info = client.model_info()
  except grpc.RpcError as e:
    raise SystemExit(f"error: {FLAGS.target}: {e.code().name}: {e.details()}")
  return info.model_name, info.vocab_size, info.max_model_len


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  api_key = FLAGS.api_key or os.environ.get("MOEJAX_API_KEY")
  model, vocab_size, max_model_len = _server_limits(api_key)
  room = max_model_len - FLAGS.output_len * 2
  input_len = min(FLAGS.input_len, max(1, room // 2))
  prefix_len = min(FLAGS.prefix_len, max(1, room - 2 * input_len))
  if FLAGS.dataset == "image":
    width, height = parse_size(FLAGS.image_size)
    convs: list[Any] = make_image_dataset(FLAGS.num_prompts, width, height,
                                          FLAGS.images_per_request, FLAGS.output_len,
                                          FLAGS.image_repeat, FLAGS.range_ratio, FLAGS.seed)
  elif FLAGS.dataset == "agent":
    # ~3 characters a token for the tools' JSON, ~30 tokens of markup a turn, ~2 tokens a
    # word; the last turn's prompt holds the system prompt, the task, every answer and result.
    budget = (max_model_len - FLAGS.output_len - 30 * FLAGS.num_turns
              - (len(json.dumps(AGENT_TOOLS)) // 3 if FLAGS.agent_tools else 0))
    words = max(1, budget // 2 // (FLAGS.num_turns * 2 + 2))
    convs = make_agent_dataset(
        FLAGS.num_prompts, FLAGS.num_turns, min(FLAGS.prefix_len, words),
        min(FLAGS.input_len, words), min(FLAGS.output_len, words), FLAGS.range_ratio,
        FLAGS.seed)
  else:
    if not vocab_size:
      raise SystemExit("error: the server does not report its vocabulary size (token-id "
                       "datasets need it); try --dataset=agent")
    convs = make_dataset(FLAGS.dataset, FLAGS.num_prompts, vocab_size, max_model_len,
                         input_len, FLAGS.output_len, FLAGS.range_ratio, prefix_len,
                         FLAGS.num_prefixes, FLAGS.num_turns, FLAGS.seed)
  target = FLAGS.base_url if FLAGS.backend == "openai" else FLAGS.target
  results, duration = asyncio.run(run_benchmark(
      target, convs, FLAGS.concurrency, FLAGS.request_rate, FLAGS.seed, api_key,
      FLAGS.backend, model, FLAGS.agent_tools))
  summary = summarize(results, duration)
  summary["config"] = dict(backend=FLAGS.backend, target=target, model=model,
                           dataset=FLAGS.dataset, num_prompts=FLAGS.num_prompts,
                           concurrency=FLAGS.concurrency, request_rate=str(FLAGS.request_rate),
                           seed=FLAGS.seed, input_len=input_len, output_len=FLAGS.output_len,
                           **(dict(image_size=FLAGS.image_size,
                                   images_per_request=FLAGS.images_per_request,
                                   image_repeat=FLAGS.image_repeat)
                              if FLAGS.dataset == "image" else {}))
  print(f"moejax serving benchmark: {FLAGS.dataset}, {FLAGS.num_prompts} requests, "
        f"concurrency {FLAGS.concurrency}, rate {FLAGS.request_rate}/s against {target} "
        f"({FLAGS.backend})")
  print(format_table(summary))
  print(json.dumps(summary))  # the last line: machine-readable
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as fh:
      json.dump(summary, fh, indent=1)
  return 0 if summary["failed"] == 0 else 1
