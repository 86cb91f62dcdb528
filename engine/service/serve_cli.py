"""Launches the gRPC server over a checkpoint.

    python -m engine.serve                                   # the bundled demo model, :50051
    python -m engine.serve --checkpoint=DIR --port=50051 --max_num_seqs=64 --metrics_port=9090
    python -m engine.serve --api_keys_file=keys.txt --tls_cert=cert.pem --tls_key=key.pem
    python -m engine.serve --http_port=8000                  # and the OpenAI HTTP API on :8000

Prints where it listens, then "ready" once every shape is compiled (health turns SERVING).
SIGTERM or Ctrl-C drains: health NOT_SERVING, new requests UNAVAILABLE, in-flight requests get
--drain_timeout_s to finish.

One replica over several hosts: every host runs the same command; process 0 serves, the others
follow it (`multihost.py`). The job comes from --coordinator_address/--num_processes/
--process_id, or from LeaderWorkerSet's, SLURM's or Open MPI's environment (`launch_env.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging as std_logging
import os
import signal
import sys
import time

from absl import flags
from absl import logging
import jax

import engine
from engine.api import DEMO_CHECKPOINT, eagle3_checkpoint
from engine.runtime import compile_cache
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.speculative import drafters
from engine.service import lockstep, mesh_flags, multihost
from engine.chat.parsers import PARSER_FAMILIES
from engine.chat.reasoning import ReasoningConfig
from engine.service.server import InferenceServer, ServerConfig, read_api_keys

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", DEMO_CHECKPOINT, "Orbax (moejax) or Hugging Face checkpoint "
                    "directory (default: the bundled demo model).")
flags.DEFINE_string("model_name", None, "Name reported by GetModelInfo (default: the "
                    "checkpoint directory's name).")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "Parameter dtype override.")
flags.DEFINE_string("host", "0.0.0.0", "Address to bind.")
flags.DEFINE_integer("port", 50051, "Port to bind (0: any free port).", lower_bound=0)
flags.DEFINE_integer("http_port", None, "Also serve the OpenAI-compatible HTTP API "
                     "(/v1/chat/completions, /v1/completions, /v1/models, /health) on this "
                     "port, same engine and address (0: any free port; default: off).",
                     lower_bound=0)
flags.DEFINE_integer("max_num_seqs", 16, "Running requests at once.", lower_bound=1)
flags.DEFINE_integer("max_num_batched_tokens", 256, "Tokens per engine step.", lower_bound=1)
flags.DEFINE_integer("num_pages", None, "KV cache pages (default: from "
                     "--kv_cache_memory_fraction on GPU, room for every sequence on CPU).")
flags.DEFINE_float("kv_cache_memory_fraction", 0.85, "Fraction of free device memory for the "
                   "KV cache.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV cache page.", lower_bound=1)
flags.DEFINE_integer("max_model_len", None, "Context length served (default: min(model, 4096)).")
flags.DEFINE_integer("max_decode_steps", 16, "Decode iterations per device loop.", lower_bound=1)
flags.DEFINE_list("decode_batch_sizes", [], "Batch sizes the decode loop is compiled for "
                  "(--max_num_seqs is always one; default: powers of two up to it, or chosen "
                  "from --traffic_stats_path).")
flags.register_validator("decode_batch_sizes", lambda v: all(x.isdigit() for x in v),
                         "--decode_batch_sizes: positive integers, comma-separated")
flags.DEFINE_string("compilation_cache_dir", compile_cache.default_dir(),
                    "JAX persistent compilation cache: a restart loads, not recompiles ('' off; "
                    f"default ${compile_cache.ENV} or ~/.cache/moejax/jax_cache).")
flags.DEFINE_enum("speculative", drafters.OFF, [drafters.OFF, drafters.AUTO, *drafters.names()],
                  "Default speculative drafter of decode-only steps (requests may choose "
                  "another, see --drafters): n-gram prompt lookup, a table learned across "
                  "requests, the checkpoint's MTP layer, or --draft_checkpoint (lossless); "
                  "auto: per request, whichever of --drafters measures the best goodput.")
flags.DEFINE_list("drafters", [], "More drafters requests may choose (SpeculativeOptions).")
flags.DEFINE_integer("num_draft_tokens", 4, "Draft tokens per step with --speculative.",
                     lower_bound=1)
flags.DEFINE_bool("adaptive_k", False, "Choose every step whether to draft (up to "
                  "--num_draft_tokens per row) or decode plainly, from measured acceptance and "
                  "costs measured at warm-up.")
flags.DEFINE_bool("measure_spec_costs", True, "Time the speculative cost table at warm-up "
                  "(else the roofline: a decode step reads the weights once).")
flags.DEFINE_bool("structured_warmup", False, "Warm-up also compiles the masked step of "
                  "constrained rows (structured outputs, tool_choice required), so the first "
                  "such request does not compile it (off: its five programs cost the demo's cold "
                  "warm-up ~90 s more on 2 CPU cores, more than the rest; BENCHMARKS.md).")
flags.DEFINE_string("draft_checkpoint", None, "Draft model directory (same tokenizer) for the "
                    "'draft' drafter.")
flags.DEFINE_string("eagle3_checkpoint", None, "EAGLE-3 head directory (as published) for the "
                    "'eagle3' drafter (default: checkpoints/demo/eagle3 with the demo target); "
                    "given, requests may choose eagle3 and auto includes it.")
flags.DEFINE_string("traffic_stats_path", None, "Histogram of step shapes: read at start to "
                    "choose the compiled buckets, written back at shutdown.")
flags.DEFINE_string("api_keys_file", None, "File with one API key per line: clients must send "
                    "`authorization: Bearer <key>`.")
flags.DEFINE_string("tls_cert", None, "PEM certificate chain (with --tls_key).")
flags.DEFINE_string("tls_key", None, "PEM private key (with --tls_cert).")
flags.DEFINE_integer("metrics_port", None, "Prometheus /metrics port (default: off).")
flags.DEFINE_string("metrics_host", None, "Address the /metrics listener binds (default: "
                    "--host).")
flags.DEFINE_float("drain_timeout_s", 30.0, "Time in-flight requests get on shutdown.")
flags.DEFINE_integer("max_queue_requests", 256, "Waiting requests before RESOURCE_EXHAUSTED.")
flags.DEFINE_integer("max_queue_tokens", 1 << 18, "Waiting prompt tokens before "
                     "RESOURCE_EXHAUSTED.")
flags.DEFINE_integer("max_message_bytes", 4 << 20, "Largest request message.")
flags.DEFINE_integer("max_prompt_chars", 1 << 20, "Longest text prompt (Generate, Tokenize), "
                     "refused before tokenising; ~4 characters per token for English text.",
                     lower_bound=1)
flags.DEFINE_integer("keepalive_time_ms", 30_000, "Server keepalive ping period.")
flags.DEFINE_integer("keepalive_timeout_ms", 10_000, "Close a connection whose ping goes "
                     "unanswered this long.")
flags.DEFINE_float("stats_log_interval_s", 10.0, "One-line stats log period (0: off).")
flags.DEFINE_integer("think_start_token_id", None, "Reasoning parser: think-start token id.")
flags.DEFINE_integer("think_end_token_id", None, "Reasoning parser: think-end token id.")
flags.DEFINE_enum("chat_parser", None, list(PARSER_FAMILIES), "Output parser of chat requests "
                  "(tool calls, reasoning; default: from the chat template's tool markup, else "
                  "the model type).")
flags.DEFINE_integer("max_images_per_request", 8, "Most images in one chat request.",
                     lower_bound=0)
flags.DEFINE_integer("max_image_bytes", 8 << 20, "Largest image file (decoded data: URL, "
                     "fetched body, gRPC image part).", lower_bound=1)
flags.DEFINE_integer("max_image_pixels", 4096 * 4096, "Largest image, width x height "
                     "(checked on the file's header, before decoding).", lower_bound=1)
flags.DEFINE_bool("allow_image_urls", False, "Fetch http(s) image URLs of chat requests "
                  "(with --image_url_timeout_s and --max_image_bytes; off: refused with 400).")
flags.DEFINE_float("image_url_timeout_s", 10.0, "Time limit of one image URL fetch.")
flags.DEFINE_integer("responses_store_size", 1024, "Responses /v1/responses keeps in memory "
                     "for previous_response_id and GET (oldest dropped first; 0: none).",
                     lower_bound=0)
flags.DEFINE_bool("request_log", False, "Log one line per request: id, API, prompt, "
                  "completion and cached tokens, TTFT, total time, finish reason.")
flags.DEFINE_integer("encoder_cache_mb", 256, "Image encoder outputs kept for images sent "
                     "again (MiB).", lower_bound=0)
flags.DEFINE_integer("lockstep_port", 0, "Multi-process: the leader's port for its followers' "
                     "lockstep channel (0: any free port, told to the followers at start).",
                     lower_bound=0, upper_bound=65535)
flags.DEFINE_bool("starts_in_reasoning", False, "Generation starts inside the reasoning (the "
                  "chat template already wrote think-start).")


def _architecture(path: str) -> str:
  try:
    with open(os.path.join(path, "config.json")) as fh:
      return (json.load(fh).get("architectures") or [""])[0]
  except (OSError, ValueError):
    return ""


def server_config() -> ServerConfig:
  if bool(FLAGS.tls_cert) != bool(FLAGS.tls_key):
    raise SystemExit("error: give both --tls_cert and --tls_key, or neither")
  if (FLAGS.think_start_token_id is None) != (FLAGS.think_end_token_id is None):
    raise SystemExit("error: give both --think_start_token_id and --think_end_token_id")
  reasoning = None
  if FLAGS.think_end_token_id is not None:
    reasoning = ReasoningConfig(FLAGS.think_start_token_id, FLAGS.think_end_token_id,
                                FLAGS.starts_in_reasoning)
  return ServerConfig(
      host=FLAGS.host, port=FLAGS.port, http_port=FLAGS.http_port, metrics_host=FLAGS.metrics_host,
      model_name=FLAGS.model_name or os.path.basename(os.path.normpath(FLAGS.checkpoint)),
      architecture=_architecture(FLAGS.checkpoint),
      max_queue_requests=FLAGS.max_queue_requests, max_queue_tokens=FLAGS.max_queue_tokens,
      drain_timeout_s=FLAGS.drain_timeout_s,
      api_keys=read_api_keys(FLAGS.api_keys_file) if FLAGS.api_keys_file else frozenset(),
      tls_cert=FLAGS.tls_cert, tls_key=FLAGS.tls_key, max_message_bytes=FLAGS.max_message_bytes,
      max_prompt_chars=FLAGS.max_prompt_chars,
      keepalive_time_ms=FLAGS.keepalive_time_ms, keepalive_timeout_ms=FLAGS.keepalive_timeout_ms,
      stats_log_interval_s=FLAGS.stats_log_interval_s, reasoning=reasoning,
      chat_parser=FLAGS.chat_parser, max_images_per_request=FLAGS.max_images_per_request,
      max_image_bytes=FLAGS.max_image_bytes, max_image_pixels=FLAGS.max_image_pixels,
      allow_image_urls=FLAGS.allow_image_urls, image_url_timeout_s=FLAGS.image_url_timeout_s,
      responses_store_size=FLAGS.responses_store_size, request_log=FLAGS.request_log)


async def serve(eng: Engine, config: ServerConfig, metrics_port: int | None,
                group: multihost.Group | None = None) -> None:
  server = InferenceServer(eng, config)
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
  if group is not None:
    multihost.watch(group, server, loop)
  t0 = time.perf_counter()
  print(f"[moejax] binding {config.host}:{config.port}; compiling (health NOT_SERVING until "
        "ready) ...", file=sys.stderr, flush=True)
  port = await server.start(metrics_port)
  if group is not None:
    multihost.serving(group)
  metrics = (f", metrics on {server.metrics_address}:{server.metrics_port}/metrics"
             if server.metrics_port else "")
  if server.http_port is not None:
    metrics = f", OpenAI HTTP API on http://{config.host}:{server.http_port}/v1" + metrics
  scheme = "TLS" if config.tls_cert else "plaintext"
  print(f"[moejax] ready: {config.model_name} on {config.host}:{port} ({scheme}"
        f"{', API keys' if config.api_keys else ''}{metrics}) after "
        f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
  await server.wait()
  eng.save_traffic_stats()  # the next start compiles buckets fitted to this traffic
  print("[moejax] stopped", file=sys.stderr, flush=True)


class _OwnInfoOnly(std_logging.Filter):
  """INFO lines from moejax only: libraries' (orbax's restore diary, JAX's backend probing
  "Unable to initialize backend 'tpu' ... Failed to open libtpu.so") read like errors."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.levelno >= std_logging.WARNING or record.pathname.startswith(_ENGINE_DIR)


_ENGINE_DIR = os.path.dirname(os.path.abspath(engine.__file__))


def main(argv: list[str]) -> int:
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.INFO)  # the periodic stats line
    logging.get_absl_handler().addFilter(_OwnInfoOnly())
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  if not os.path.isdir(FLAGS.checkpoint):
    raise SystemExit(f"error: checkpoint directory not found: {FLAGS.checkpoint}")
  os.environ[compile_cache.ENV] = FLAGS.compilation_cache_dir  # for engine.load too
  joined = False
  try:
    config = server_config()
    job = mesh_flags.job()
    if job is not None:
      mesh_flags.join(job)
      joined = True
    mesh = mesh_flags.mesh()
    model = engine.load(FLAGS.checkpoint, dtype=FLAGS.dtype, mesh=mesh,
                        kernels=mesh_flags.kernel_choice())
    draft = (engine.load(FLAGS.draft_checkpoint, dtype=FLAGS.dtype, mesh=mesh)
             if FLAGS.draft_checkpoint else None)
    head, extra_drafters, head_dir = None, (), None
    # A head when one is asked for: --eagle3_checkpoint, or eagle3 / auto as the default or
    # among --drafters (the demo target's own head then, if no flag names one).
    if FLAGS.eagle3_checkpoint or FLAGS.speculative in ("eagle3", drafters.AUTO) or (
        "eagle3" in FLAGS.drafters):
      head_dir = eagle3_checkpoint(
          "eagle3" if "eagle3" in (FLAGS.speculative, *FLAGS.drafters) else drafters.AUTO,
          FLAGS.eagle3_checkpoint, FLAGS.checkpoint)
    if head_dir is not None:
      head = model.llm.head(head_dir)
      extra_drafters = ("eagle3",)  # (requests may choose it; auto includes it)
    eng = Engine.from_model(model, EngineConfig(
        page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
        kv_cache_memory_fraction=FLAGS.kv_cache_memory_fraction,
        max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        max_model_len=FLAGS.max_model_len, max_decode_steps=FLAGS.max_decode_steps,
        decode_batch_sizes=tuple(int(b) for b in FLAGS.decode_batch_sizes) or None,
        compilation_cache_dir=FLAGS.compilation_cache_dir,
        traffic_stats_path=FLAGS.traffic_stats_path,
        speculative=None if FLAGS.speculative == drafters.OFF else FLAGS.speculative,
        drafters=tuple(dict.fromkeys((*FLAGS.drafters, *extra_drafters))),
        num_draft_tokens=FLAGS.num_draft_tokens,
        adaptive_k=FLAGS.adaptive_k, measure_spec_costs=FLAGS.measure_spec_costs,
        encoder_cache_bytes=FLAGS.encoder_cache_mb << 20,
        constrained_warmup=FLAGS.structured_warmup),
        draft_model=draft, head=head)
    group = None
    if jax.process_count() > 1:
      group = multihost.connect(eng, multihost.Settings(
          coordinator_host=(job.coordinator_address.rpartition(":")[0].strip("[]")
                            if job is not None and job.coordinator_address else None),
          lockstep_port=FLAGS.lockstep_port, connect_timeout_s=FLAGS.coordinator_timeout_s,
          heartbeat_timeout_s=FLAGS.heartbeat_timeout_s,
          drain_timeout_s=FLAGS.drain_timeout_s, step_timeout_s=FLAGS.step_timeout_s),
          extra=dict(checkpoint=FLAGS.checkpoint, draft_checkpoint=FLAGS.draft_checkpoint,
                     eagle3_checkpoint=head_dir))
  except (ValueError, FileNotFoundError, OSError, NotImplementedError,
          lockstep.LockstepError) as e:
    if joined:  # not through jax's shutdown barrier, which would wait for the other processes
      print(f"error: {e}", file=sys.stderr, flush=True)
      os._exit(1)
    raise SystemExit(f"error: {e}") from None
  if group is not None and group.follower is not None:
    return multihost.follow(eng, group, FLAGS.host, FLAGS.http_port)
  if group is not None:
    multihost.lead(eng, group)
  asyncio.run(serve(eng, config, FLAGS.metrics_port, group))
  if group is not None:
    multihost.leave(group)
  return 0
