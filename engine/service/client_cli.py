r"""Streams a generation from a running server.

    python -m engine.client --prompt="def fib(n):" --max_tokens=64
    python -m engine.client --target=HOST:PORT --prompt_ids=1,5,6 --json
    python -m engine.client --chat --prompt="def fib(n):"        # one user message, via Chat
    python -m engine.client --chat --image=cat.png --prompt="What is this?"   # with an image
    python -m engine.client --prompt="import " --choice=os --choice=sys   # constrained output
    python -m engine.client --prompt="x" --json_schema=@schema.json --strict  # or --regex, --grammar
    python -m engine.client --info                                # model info and server load
    python -m engine.client --list              # services and methods (server reflection)

Text is printed as it streams; timings go to stderr. `--json` prints one JSON object with ids,
text, finish reason, matched stop, usage and server timings. `--stop` takes backslash escapes
(`--stop='\n\n'` is two newlines; `\\` a backslash). The API key comes from --api_key or
$MOEJAX_API_KEY. Errors print the gRPC status and exit 1.
"""

from __future__ import annotations

import json
import os
import sys
import time

import grpc
from absl import flags
from google.protobuf import descriptor_pool, json_format
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from engine.service.client import FINISH_NAMES, Completion, InferenceClient, build_request
from engine.service.proto import inference_pb2 as pb

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "127.0.0.1:50051", "Server address HOST:PORT.")
flags.DEFINE_string("prompt", None, "Prompt text.")
flags.DEFINE_string("prompt_ids", None, "Comma-separated prompt token ids.")
flags.DEFINE_bool("chat", False, "Send --prompt as a user message through Chat (the model's "
                  "chat template; reasoning and tool calls parsed).")
flags.DEFINE_string("system", None, "--chat: a system message first.")
flags.DEFINE_multi_string("image", [], "--chat: an image file sent before the prompt "
                          "(repeatable; models with a vision tower).")
flags.DEFINE_string("request_id", "", "Request id (default: assigned by the server).")
flags.DEFINE_integer("max_tokens", None, "Tokens to generate (server default 64).")
flags.DEFINE_integer("min_tokens", None, "Stops are not honoured before this many tokens.")
flags.DEFINE_float("temperature", None, "0 is greedy (server default).")
flags.DEFINE_integer("top_k", None, "Keep the k most likely tokens (0: off).")
flags.DEFINE_float("top_p", None, "Nucleus mass (1: off).")
flags.DEFINE_float("min_p", None, "Drop tokens below min_p * p(most likely).")
flags.DEFINE_integer("seed", None, "Sampling seed.")
flags.DEFINE_multi_string("stop", [], "Stop string (repeatable); backslash escapes such as "
                          "\\n, \\t, \\\\ and \\uXXXX are decoded.")
flags.DEFINE_multi_integer("stop_token_id", [], "Stop token id (repeatable).")
flags.DEFINE_bool("ignore_eos", False, "Do not stop at EOS.")
flags.DEFINE_string("json_schema", None, "Constrain the output to a JSON schema (JSON text, or "
                    "@FILE).")
flags.DEFINE_bool("strict", False, "--json_schema: only the declared keys.")
flags.DEFINE_string("regex", None, "Constrain the output to a regular expression.")
flags.DEFINE_multi_string("choice", [], "Constrain the output to one of these (repeatable).")
flags.DEFINE_string("grammar", None, "Constrain the output to an llguidance Lark grammar (text, "
                    "or @FILE).")
flags.DEFINE_string("api_key", None, "API key (default: $MOEJAX_API_KEY).")
flags.DEFINE_bool("tls", False, "Use TLS (system roots, or --ca_cert).")
flags.DEFINE_string("ca_cert", None, "PEM root certificate for TLS.")
flags.DEFINE_float("timeout_s", None, "Deadline for the whole call.")
flags.DEFINE_bool("json", False, "Print one JSON object instead of streaming text.")
flags.DEFINE_bool("info", False, "Print GetModelInfo and GetServerLoad, then exit.")
flags.DEFINE_bool("list", False, "List the server's services and their methods (server "
                  "reflection, as `grpcurl list` does), then exit.")


def unescape(text: str) -> str:
  """Decodes Python-style backslash escapes, leaving other characters (non-ASCII too) as they
  are: a shell passes `--stop="\\n"` as a backslash and an n."""
  try:
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
  except UnicodeDecodeError as e:
    raise SystemExit(f"--stop: bad backslash escape in {text!r} ({e.reason})") from None


def _text_or_file(value: str) -> str:
  if value.startswith("@"):
    with open(value[1:], encoding="utf-8") as fh:
      return fh.read()
  return value


def structured_outputs() -> pb.StructuredOutputs | None:
  """The constraint flags as a StructuredOutputs (the server validates it)."""
  given = [name for name in ("json_schema", "regex", "choice", "grammar") if FLAGS[name].value]
  if len(given) > 1:
    raise SystemExit(f"give at most one of --json_schema, --regex, --choice, --grammar "
                     f"(got {', '.join('--' + g for g in given)})")
  if not given:
    return None
  if given[0] == "choice":
    return pb.StructuredOutputs(choice=pb.Choices(values=FLAGS.choice))
  if given[0] == "regex":
    return pb.StructuredOutputs(regex=FLAGS.regex)
  if given[0] == "grammar":
    return pb.StructuredOutputs(grammar=_text_or_file(FLAGS.grammar))
  return pb.StructuredOutputs(json_schema=_text_or_file(FLAGS.json_schema), strict=FLAGS.strict)


def list_services(channel: grpc.Channel) -> list[str]:
  """'service' lines, each followed by its '  service.Method' lines."""
  db = ProtoReflectionDescriptorDatabase(channel)
  pool = descriptor_pool.DescriptorPool(db)
  lines = []
  for name in sorted(db.get_services()):
    lines.append(name)
    lines += [f"  {name}.{m.name}" for m in pool.FindServiceByName(name).methods]
  return lines


def _chat(client: InferenceClient) -> int:
  if FLAGS.prompt is None:
    raise SystemExit("--chat takes --prompt")
  user: str | list[dict] = FLAGS.prompt
  if FLAGS.image:  # image files first, then the text (ContentPart images: the file's bytes)
    images = []
    for path in FLAGS.image:
      with open(path, "rb") as fh:
        images.append({"type": "image", "image": fh.read()})
    user = images + [{"type": "text", "text": FLAGS.prompt}]
  messages = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) + [
      {"role": "user", "content": user}]
  parts: dict[str, list[str]] = {"reasoning_content": [], "content": []}
  final, calls = None, []
  for r in client.chat_stream(messages, stop=[unescape(x) for x in FLAGS.stop],
                              ignore_eos=FLAGS.ignore_eos, max_tokens=FLAGS.max_tokens,
                              temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                              seed=FLAGS.seed, request_id=FLAGS.request_id,
                              structured_outputs=structured_outputs()):
    parts["reasoning_content"].append(r.reasoning_content)
    parts["content"].append(r.content)
    if not FLAGS.json:
      print(r.reasoning_content + r.content, end="", flush=True)
    if r.HasField("final"):
      final = r.final
      calls = [json_format.MessageToDict(c) for c in r.complete_tool_calls]
  reason = FINISH_NAMES.get(final.finish_reason) if final is not None else None
  usage = json_format.MessageToDict(final.usage) if final is not None else {}
  if FLAGS.json:
    print(json.dumps({k: "".join(v) for k, v in parts.items()} | dict(
        tool_calls=calls, finish_reason=reason, usage=usage)))
  else:
    for call in calls:
      print(f"\n[tool call] {json.dumps(call)}")
    print(f"\n[moejax] finish={reason}, usage {usage}", file=sys.stderr)
  return 0


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  roots = None
  if FLAGS.ca_cert:
    with open(FLAGS.ca_cert, "rb") as fh:
      roots = fh.read()
  client = InferenceClient(FLAGS.target, api_key=FLAGS.api_key or
                           os.environ.get("MOEJAX_API_KEY"), tls=FLAGS.tls,
                           root_certificates=roots, timeout=FLAGS.timeout_s)
  try:
    if FLAGS.info:
      for msg in (client.model_info(), client.server_load()):
        print(json.dumps(json_format.MessageToDict(
            msg, always_print_fields_with_no_presence=True), indent=1))
      return 0
    if FLAGS.list:
      print("\n".join(list_services(client.channel)))
      return 0
    if (FLAGS.prompt is None) == (FLAGS.prompt_ids is None):
      raise SystemExit("give exactly one of --prompt or --prompt_ids")
    try:
      prompt = FLAGS.prompt if FLAGS.prompt is not None else [
          int(x) for x in FLAGS.prompt_ids.split(",") if x.strip()]
    except ValueError:
      raise SystemExit(f"--prompt_ids must be comma-separated integers: {FLAGS.prompt_ids!r}")
    if FLAGS.chat:
      return _chat(client)
    request = build_request(
        prompt, request_id=FLAGS.request_id, stop=[unescape(x) for x in FLAGS.stop],
        stop_token_ids=FLAGS.stop_token_id, ignore_eos=FLAGS.ignore_eos,
        max_tokens=FLAGS.max_tokens, min_tokens=FLAGS.min_tokens,
        temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, min_p=FLAGS.min_p,
        seed=FLAGS.seed, structured_outputs=structured_outputs())
    done = Completion(sent_at=time.perf_counter())
    for chunk in client.stream(request):
      done.add(chunk)
      if not FLAGS.json:
        print(chunk.reasoning_text + chunk.text, end="", flush=True)
  except grpc.RpcError as e:
    print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1
  finally:
    client.close()
  if FLAGS.json:
    print(json.dumps(done.as_dict()))
  else:
    ttft = (done.chunk_times[0] - done.sent_at) if done.chunk_times else 0.0
    print(f"\n[moejax] {done.completion_tokens} tokens, finish={done.finish_reason}"
          f"{f' stop={done.stop!r}' if done.stop is not None else ''}, ttft {ttft * 1e3:.0f} ms"
          f", total {(time.perf_counter() - done.sent_at) * 1e3:.0f} ms, cached prompt tokens "
          f"{done.cached_tokens}/{done.prompt_tokens}", file=sys.stderr)
  return 0
