"""Images in serving: the prefix cache keyed by image content, the encoder-output cache,
placeholder expansion, and image inputs over both APIs (bad ones refused naming the field,
the server serving on).

The engine tests run the tiny kimi_k25 vision fixture (`tests/golden/fixtures/kimi_k25_vision`,
transformers' own model); the API tests run the demo model, which has no vision tower: every
limit is checked before that refusal, so each bad image gets its own error there.
"""

import base64
import io

import numpy as np
import openai
from PIL import Image

from engine.runtime.multimodal import EncoderCache, ImageInput, check_spans
from engine.runtime.page_pool import page_keys
from engine.service import images
from engine.service.proto import inference_pb2 as pb
from engine.service.validation import FieldError, RequestLimits
from service_harness import *  # noqa: F401,F403  (fixtures, helpers, shared imports)

from engine.model import image_processing
from engine.chat.template import ChatTemplate
from engine.model.config import config_from_dict
from engine.model.params import init_params

PAD = 7
FIXTURE = os.path.join(REPO, "tests", "golden", "fixtures", "kimi_k25_vision")
sys.path.insert(0, os.path.join(REPO, "tests", "golden"))
from vision_images import make_image  # noqa: E402  (the fixture's images, integer-made)

# A K2.5 user turn as the fixture's golden prompts are made (images first, then the text;
# the generation prompt opens <think>); it loops over content parts, as Kimi's templates do.
K25_TEMPLATE = (
    "{%- for m in messages -%}<|im_user|>{{ m.role }}<|im_middle|>"
    "{%- for c in m.content -%}{%- if c.type == 'image' -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{%- else -%}{{ c.text }}{%- endif -%}{%- endfor -%}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>{%- endif -%}")
VISION_CONFIG = EngineConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=98,
                             row_widths=(16,), max_model_len=128, max_decode_steps=4)


def png(w, h, seed=0, fmt="PNG"):
  rng = np.random.default_rng(seed)
  buf = io.BytesIO()
  Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt)
  return buf.getvalue()


def png_of(img):
  buf = io.BytesIO()
  img.save(buf, format="PNG")
  return buf.getvalue()


def data_url(data, mime="image/png"):
  return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_input(offset, n, key):
  return ImageInput(np.zeros((1, 4), np.float32), (1, 2, 2), key, offset, n)


# ---- hashing, expansion, the encoder cache ---------------------------------------------------

def test_page_keys_name_the_image_content():
  ids = [1, 2, 3, 4] + [PAD] * 6 + [5, 6, 7, 8, 9, 10]   # an image on positions 4..9
  a, b = [image_input(4, 6, "A")], [image_input(4, 6, "B")]
  ka, kb, ka2 = (page_keys(ids, 4, images=x) for x in (a, b, [image_input(4, 6, "A")]))
  text = page_keys(ids, 4)
  assert ka == ka2                          # the same image: the same prefix
  assert ka[0] == kb[0] == text[0]          # page 0 holds no placeholder
  assert ka[1] != kb[1] and ka[2] != kb[2]  # pages 1 and 2 hold the image's positions
  assert ka[3] != kb[3]                     # and every key after them names the whole prefix
  assert ka[1] != text[1]                   # an image page is never a text page
  # Incremental hashing (`known`) gives the same keys.
  assert page_keys(ids, 4, known=ka[:2], images=a) == ka


def test_expand_placeholders_and_spans():
  ids, spans = images.expand([1, PAD, 2, PAD, PAD, 3], PAD, [3, 2, 1])
  assert ids == [1, PAD, PAD, PAD, 2, PAD, PAD, PAD, 3]
  assert spans == [(1, 3), (5, 2), (7, 1)]   # adjacent images keep their own spans
  with pytest.raises(FieldError, match="2 image placeholders") as e:
    images.expand([1, PAD, PAD], PAD, [4])
  assert e.value.field == "messages"
  ids, spans = images.expand([1, PAD, 2, PAD, 3], PAD, [3, 2])
  ims = [image_input(o, n, str(o)) for o, n in spans]
  check_spans(ids, ims, PAD)
  with pytest.raises(ValueError, match="belongs to no image"):
    check_spans(ids + [PAD], ims, PAD)
  with pytest.raises(ValueError, match=r"images\[0\]"):
    check_spans(ids, [image_input(0, 3, "x")], PAD)
  with pytest.raises(ValueError, match="no vision tower"):
    check_spans(ids, ims, None)


def test_encoder_cache_is_lru_and_bounded_in_bytes():
  cache = EncoderCache(max_bytes=3 * 400)
  for key in "abc":
    cache.put(key, np.zeros((100,), np.float32))   # 400 bytes each
  assert cache.get("a") is not None                # a is now the most recent
  cache.put("d", np.zeros((100,), np.float32))     # evicts b, the least recent
  assert cache.get("b") is None and cache.get("c") is not None and len(cache) == 3
  cache.put("huge", np.zeros((1000,), np.float32))  # larger than the cache: not kept
  assert cache.get("huge") is None and cache.num_bytes == 1200
  assert (cache.hits, cache.misses, cache.evictions) == (2, 2, 1)


def test_decoding_and_content_hashes():
  limits = RequestLimits(vocab_size=10, max_model_len=10, num_eos_ids=1)
  messages = [{"role": "user", "content": [
      {"type": "text", "text": "look"},
      {"type": "image_url", "image_url": {"url": data_url(png(8, 6))}},
      {"type": "image_url", "image_url": data_url(png(8, 6, fmt="BMP"), "image/bmp")},
      {"type": "image_url", "image_url": {"url": data_url(png(8, 6, seed=1))}}]}]
  shaped, found = images.extract(messages, limits)
  assert shaped[0]["content"] == [{"type": "text", "text": "look"}] + [{"type": "image"}] * 3
  assert [f.field for f in found] == [f"messages[0].content[{j}].image_url" for j in (1, 2, 3)]
  assert found[0].image.size == (8, 6) and found[0].image.mode == "RGB"
  h = [images.content_hash(f.image, "params") for f in found]
  assert h[0] == h[1] != h[2]   # the same pixels in another file format: the same content
  assert images.content_hash(found[0].image, "other params") != h[0]


# ---- image inputs over both APIs (the demo model: no vision tower) ----------------------------

@pytest.fixture(scope="module")
def eng(demo):
  """The harness's demo engine without its warm-up: these tests generate 3 tokens twice."""
  return Engine.from_model(demo, ENGINE_CONFIG)


LIMITS = dict(max_images_per_request=2, max_image_bytes=4000, max_image_pixels=64 * 64)


def bad_openai_cases():
  small = {"type": "image_url", "image_url": {"url": data_url(png(8, 8))}}
  text = {"type": "text", "text": "what is this?"}

  def user(*parts):
    return [{"role": "user", "content": list(parts)}]
  f = "messages[0].content[1].image_url"
  return [
      (user(text, {"type": "image_url", "image_url": {"url": data_url(b"not an image")}}), f,
       "not a decodable image"),
      (user(text, {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}), f,
       "not valid base64"),
      (user(text, {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}),
       f, "--allow_image_urls"),
      (user(text, {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}), f,
       "unsupported URL scheme"),
      (user(text, small, small, small), "messages[0].content[3].image_url", "more than 2"),
      (user(text, {"type": "image_url", "image_url": {"url": data_url(png(60, 60))}}), f,
       "at most 4000 allowed"),
      (user(text, {"type": "image_url", "image_url": {"url": data_url(png(65, 64,
                                                                          fmt="BMP"))}}),
       f, "at most 4096 allowed"),
      (user(text, {"type": "image"}), "messages[0].content[1].type", "carry no image"),
      (user(text, small), f, "no vision tower"),
  ]


@pytest.mark.slow
def test_bad_images_over_http_are_400_naming_the_field(serve, eng):
  bg = serve(http_port=0, model_name="demo", **{**LIMITS, "max_image_bytes": 20000})
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{bg.server.http_port}/v1",
                         api_key="none", max_retries=0, timeout=120)
  for messages, field, why in bad_openai_cases():
    if why == "at most 4000 allowed":
      continue  # this server allows 20000 bytes (the gRPC test checks the byte limit)
    with pytest.raises(openai.BadRequestError) as e:
      client.chat.completions.create(model="demo", messages=messages, max_tokens=2)
    assert e.value.param == field and why in e.value.message, (field, e.value.message)
  rejected = bg.server.metrics.request_rejected.labels(code="INVALID_ARGUMENT")._value.get()
  assert rejected == len(bad_openai_cases()) - 1
  out = client.chat.completions.create(model="demo", max_tokens=3, messages=[
      {"role": "user", "content": [{"type": "text", "text": PROMPT}]}])
  assert out.usage.completion_tokens == 3   # still serving


@pytest.mark.slow
def test_bad_images_over_grpc_are_invalid_argument_naming_the_field(serve, eng):
  bg = serve(**LIMITS)
  f = "messages[0].content_parts[1].image"

  def request(*images_):
    req = pb.ChatRequest(sampling=pb.SamplingParams(max_tokens=2))
    msg = req.messages.add(role="user")
    msg.content_parts.add(text="what is this?")
    for data in images_:
      msg.content_parts.add(image=pb.ImageData(data=data))
    return req
  cases = [(request(b"\x89PNG\r\n\x1a\n garbage"), f, "not a decodable image"),
           (request(b""), f, "empty image"),
           (request(png(8, 8), png(8, 8), png(8, 8)), "messages[0].content_parts[3].image",
            "more than 2"),
           (request(png(60, 60)), f, "at most 4000 allowed"),
           (request(png(8, 8)), f, "no vision tower")]
  both = pb.ChatRequest()
  both.messages.add(role="user", content="x").content_parts.add(text="y")
  cases.append((both, "messages[0].content_parts", "not both"))
  with InferenceClient(target(bg)) as client:
    for req, field, why in cases:
      code, details = status_of(lambda: list(client.stub.Chat(req)))
      assert code == grpc.StatusCode.INVALID_ARGUMENT, details
      assert details.startswith(field) and why in details, details
    last = list(client.chat_stream([{"role": "user", "content": [
        {"type": "text", "text": PROMPT}]}], max_tokens=3))[-1]
    assert last.final.usage.completion_tokens == 3   # still serving


def test_image_urls_are_fetched_only_when_allowed():
  import http.server
  import threading
  files = {"/cat.png": png(8, 8), "/big.png": png(60, 60)}

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
      if self.path == "/slow.png":
        time.sleep(2)
      body = files.get(self.path, b"")
      self.send_response(200 if body else 404)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=httpd.serve_forever, daemon=True).start()
  base = f"http://127.0.0.1:{httpd.server_address[1]}"
  allowed = RequestLimits(vocab_size=10, max_model_len=10, num_eos_ids=1, max_image_bytes=4000,
                          allow_image_urls=True, image_url_timeout_s=0.5)
  refused = dataclasses.replace(allowed, allow_image_urls=False)
  f = "messages[0].content[0].image_url"
  try:
    def extract(url, limits):
      return images.extract([{"role": "user", "content": [
          {"type": "image_url", "image_url": {"url": url}}]}], limits)[1]
    assert extract(base + "/cat.png", allowed)[0].image.size == (8, 8)
    for url, limits, why in ((base + "/cat.png", refused, "--allow_image_urls"),
                             (base + "/big.png", allowed, "at most 4000 allowed"),
                             (base + "/missing.png", allowed, "could not fetch"),
                             (base + "/slow.png", allowed, "could not fetch")):
      with pytest.raises(FieldError) as e:
        extract(url, limits)
      assert e.value.field == f and why in str(e.value), str(e.value)
  finally:
    httpd.shutdown()


def test_bench_image_dataset_and_ttft_split():
  convs = bench.make_image_dataset(6, 64, 48, 2, 8, repeat=0.5, seed=3)
  assert len(convs) == 6 and bench.parse_size("64x48") == (64, 48)
  parts = convs[0].messages[0]["content"]
  assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
  limits = RequestLimits(vocab_size=10, max_model_len=10, num_eos_ids=1)
  found = images.extract(convs[0].messages, limits)[1]
  assert [f.image.size for f in found] == [(64, 48)] * 2
  assert found[0].image.tobytes() != found[1].image.tobytes()
  repeats = sum(c.messages is p.messages for i, c in enumerate(convs) for p in convs[:i])
  assert repeats >= 1   # some requests resend earlier images (seeded)
  samples = [bench.Sample(ok=True, ttft_s=0.4, e2el_s=1.0, output_tokens=4, encode_s=0.1),
             bench.Sample(ok=True, ttft_s=0.6, e2el_s=1.0, output_tokens=4, encode_s=0.3)]
  summary = bench.summarize(samples, 2.0)
  assert summary["ttft_split"]["encode_share"] == pytest.approx(0.4)
  assert summary["ttft_split"]["prefill_ms"]["mean"] == pytest.approx(300.0)
  assert "encode share of TTFT" in bench.format_table(summary)


# ---- the engine on the tiny kimi_k25 vision fixture ------------------------------------------

@pytest.fixture(scope="module")
def k25():
  return moejax.load(FIXTURE)


@pytest.fixture(scope="module")
def golden():
  return dict(np.load(os.path.join(FIXTURE, "golden.npz")))


def rgb(img):
  return Image.fromarray(image_processing.to_rgb_array(img), "RGB")


def collapse(prompt, pad):
  """A golden prompt with each run of pads as one placeholder (what a template renders)."""
  out = []
  for t in prompt.tolist():
    if not (t == pad and out and out[-1] == pad):
      out.append(t)
  return out


def add(eng, ids, pictures, max_tokens=8, logprobs=None):
  found = [images.DecodedImage(f"images[{i}]", rgb(p)) for i, p in enumerate(pictures)]
  ids, ims = images.to_inputs(ids, found, eng.images.pad_id, eng.image_processor)
  return eng.add_request(ids, SamplingParams(logprobs=logprobs),
                         StopParams(max_tokens=max_tokens, ignore_eos=True), images=ims)


def run(eng, *rids):
  for _ in eng.run():
    pass
  out = [eng.requests[r] for r in rids]
  for r in rids:
    eng.release(r)
  return out


@pytest.mark.slow
def test_engine_greedy_equals_the_golden_tokens_chunked_and_batched(k25, golden):
  """Both golden prompts at once, in 98-token steps of 16-token rows over 4-token pages: the
  first step holds all of prompt 0 (67 tokens, image 4 at 13..28) and prompt 1's first 31
  (images 2 at 13..20 and 3 at 29..32): one tower call for the three images, image 3's span
  split between two chunks, spans across rows and pages. The greedy tokens equal
  transformers' (`make_golden_k25_vision.py`)."""
  eng = Engine.from_model(k25, VISION_CONFIG)
  pad = eng.images.pad_id
  rids = []
  for j in (0, 1):
    ids = collapse(golden[f"prompt_{j}"], pad)
    pictures = [make_image(int(i)) for i in golden[f"prompt_images_{j}"]]
    found = [images.DecodedImage(f"i{i}", rgb(p)) for i, p in enumerate(pictures)]
    full, ims = images.to_inputs(ids, found, pad, eng.image_processor)
    assert full == golden[f"prompt_{j}"].tolist()   # the expansion: the golden's pads
    n = len(golden[f"greedy_{j}"])
    rids.append(eng.add_request(full, SamplingParams(), StopParams(max_tokens=n,
                                                                   ignore_eos=True), images=ims))
  eng.step()
  second = eng.requests[rids[1]]
  assert second.num_computed == 31 and second.images[1].offset == 29
  assert list(second.image_features) == [1]   # image 3 kept for its second chunk, 2 dropped
  reqs = run(eng, *rids)
  for j, req in enumerate(reqs):
    assert req.output_ids == golden[f"greedy_{j}"].tolist(), j
    assert not req.image_features
    assert req.timings.encode_s > 0
  s = eng.stats()
  assert s["images_encoded"] == 3 and s["image_encode_calls"] == 1


@pytest.mark.slow
def test_prefix_cache_is_keyed_by_image_content(k25, golden):
  eng = Engine.from_model(k25, VISION_CONFIG)
  pad, ps = eng.images.pad_id, VISION_CONFIG.page_size
  ids = collapse(golden["prompt_0"], pad)
  picture = make_image(4)
  other = picture.transpose(Image.FLIP_LEFT_RIGHT)   # same size: the same placeholder ids
  offset = ids.index(pad)
  a = run(eng, add(eng, ids, [picture], logprobs=1))[0]
  b = run(eng, add(eng, ids, [other], logprobs=1))[0]
  assert a.prompt_ids == b.prompt_ids
  # Only the text pages before the image are shared; the outputs differ.
  assert b.usage().cached_tokens == offset // ps * ps
  assert (a.output_ids, [lp.logprob for lp in a.output_logprobs]) != \
      (b.output_ids, [lp.logprob for lp in b.output_logprobs])
  assert eng.stats()["images_encoded"] == 2
  # The same image again: its pages come from the prefix cache, the tower does not run.
  again = run(eng, add(eng, ids, [picture], logprobs=1))[0]
  assert again.usage().cached_tokens == (len(a.prompt_ids) - 1) // ps * ps > offset + 10
  assert again.output_ids == a.output_ids and eng.stats()["images_encoded"] == 2
  # Another text before the same image: no page matches, the encoder cache does.
  hits = eng.stats()["encoder_cache_hits"]
  moved = run(eng, add(eng, ids[:1] + [ord("x")] + ids[1:], [picture]))[0]
  assert moved.usage().cached_tokens == 0
  s = eng.stats()
  assert s["images_encoded"] == 2 and s["encoder_cache_hits"] == hits + 1
  eng.pool.check_invariants()


@pytest.mark.slow
def test_images_over_both_apis_reach_the_tower_and_the_prefix_cache(k25, golden, tmp_path):
  """The fixture served with a K2.5-style template: an image as a data: URL (HTTP) and as
  bytes (gRPC) renders the golden prompt; the tokens equal transformers'; the same image sent
  again is served from the prefix cache without the tower; a bad one is refused meanwhile."""
  eng = Engine.from_model(k25, VISION_CONFIG)
  eng.chat_template = ChatTemplate(K25_TEMPLATE)
  picture = png_of(make_image(4))
  messages = [{"role": "user", "content": [
      {"type": "image_url", "image_url": {"url": data_url(picture)}},
      {"type": "text", "text": "What is in this picture?"}]}]
  want = golden["greedy_0"][:6].tolist()
  with BackgroundServer(eng, dataclasses.replace(BASE, http_port=0, model_name="k25")) as bg:
    with InferenceClient(target(bg)) as client:
      chunks = list(client.chat_stream(messages, max_tokens=6, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == want
    final = chunks[-1].final
    assert final.usage.prompt_tokens == len(golden["prompt_0"]) == 67
    assert final.usage.cached_tokens == 0 and final.timings.encode_s > 0
    text = "".join(c.reasoning_content + c.content for c in chunks)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{bg.server.http_port}/v1",
                           api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:   # a corrupt image: 400, serving on
      client.chat.completions.create(model="k25", max_tokens=2, messages=[
          {"role": "user", "content": [{"type": "image_url", "image_url": {
              "url": data_url(picture[:60])}}]}])
    assert e.value.param == "messages[0].content[0].image_url"
    out = client.chat.completions.create(model="k25", messages=messages, max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    message = out.choices[0].message
    assert (message.model_extra.get("reasoning_content") or "") + (message.content or "") == text
    assert out.usage.prompt_tokens_details.cached_tokens == 64   # (67 - 1) // 4 pages of 4
    assert eng.stats()["images_encoded"] == 1
    # From the shell: engine.client --chat --image (a file's bytes as a ContentPart).
    path = os.path.join(str(tmp_path), "picture.png")
    with open(path, "wb") as fh:
      fh.write(picture)
    r = subprocess.run([sys.executable, "-m", "engine.client", f"--target={target(bg)}",
                        "--chat", f"--image={path}", "--prompt=What is in this picture?",
                        "--max_tokens=6", "--temperature=0", "--ignore_eos", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["reasoning_content"] + got["content"] == text
    assert got["usage"]["cachedTokens"] == 64
    metrics = bg.server.metrics.text()
    assert 'moejax:images_encoded_total{model_name="k25"} 1.0' in metrics
    assert 'moejax:encoder_cache_queries_total{model_name="k25"} 1.0' in metrics
  assert_idle(eng)


@pytest.mark.slow
def test_preempted_image_requests_recompute_the_same_tokens(k25, golden):
  """A pool too small for both golden prompts: one is preempted (pages and features released)
  and recomputed through the prefix and encoder caches; both still equal the golden tokens."""
  eng = Engine.from_model(k25, dataclasses.replace(VISION_CONFIG, num_pages=36))
  pad = eng.images.pad_id
  rids = [add(eng, collapse(golden[f"prompt_{j}"], pad),
              [make_image(int(i)) for i in golden[f"prompt_images_{j}"]], max_tokens=12)
          for j in (0, 1)]
  reqs = run(eng, *rids)
  assert eng.stats()["num_preemptions"] >= 1
  for j, req in enumerate(reqs):
    assert req.output_ids == golden[f"greedy_{j}"][:12].tolist(), j
  assert eng.stats()["images_encoded"] == 3   # the recompute found them in the cache
  eng.pool.check_invariants()


@pytest.mark.slow
def test_an_engine_with_the_mtp_drafter_refuses_images_and_keeps_nothing(k25, golden):
  """The MTP layer would see the image's placeholder ids, not the image: such an engine refuses
  an image request (naming `images`) and keeps nothing of it; text requests still queue."""
  with open(os.path.join(FIXTURE, "config.json")) as fh:
    d = json.load(fh)
  d["text_config"]["num_nextn_predict_layers"] = 1
  cfg = config_from_dict(d)
  model = dataclasses.replace(k25, config=cfg, params=init_params(cfg))
  eng = Engine.from_model(model, dataclasses.replace(
      VISION_CONFIG, speculative="mtp", num_draft_tokens=2, measure_spec_costs=False))
  free = eng.pool.num_free
  ids = collapse(golden["prompt_0"], eng.images.pad_id)
  with pytest.raises(ValueError, match="^images: .*mtp"):
    add(eng, ids, [make_image(int(i)) for i in golden["prompt_images_0"]])
  assert not eng.requests and eng.pool.num_free == free
  rid = eng.add_request([t for t in ids if t != eng.images.pad_id], SamplingParams(),
                        StopParams(max_tokens=2))
  assert list(eng.requests) == [rid] and eng.requests[rid].spec.drafter == "mtp"


@pytest.mark.slow
def test_image_requests_with_the_eagle3_drafter_keep_the_golden_tokens(k25, golden, tmp_path):
  """An EAGLE-3 head (random, the published MLA layout) drafts for image requests: at the
  <|media_pad|> positions it takes the pad id's token embedding, the image reaching it through
  the target's aux states there; both golden prompts, chunked and batched, still give
  transformers' greedy tokens, and the head drafted."""
  from checkpoints import train_eagle3
  from engine.model.eagle3_loader import load_eagle3
  with open(os.path.join(FIXTURE, "config.json")) as fh:
    text = json.load(fh)["text_config"]
  conf = train_eagle3.head_config_dict(text, 48, aux_ids=[0, 1, 2])
  train_eagle3.save_head(str(tmp_path), conf, train_eagle3.initial_tensors(
      conf, k25.config, k25.params, seed=1))
  head = load_eagle3(str(tmp_path), k25.config, k25.params, k25.params["embed"].dtype)
  eng = Engine.from_model(k25, dataclasses.replace(
      VISION_CONFIG, speculative="eagle3", num_draft_tokens=2, measure_spec_costs=False),
      head=head)
  pad = eng.images.pad_id
  rids = [add(eng, collapse(golden[f"prompt_{j}"], pad),
              [make_image(int(i)) for i in golden[f"prompt_images_{j}"]],
              max_tokens=len(golden[f"greedy_{j}"])) for j in (0, 1)]
  reqs = run(eng, *rids)
  for j, req in enumerate(reqs):
    assert req.output_ids == golden[f"greedy_{j}"].tolist(), j
  assert sum(r.usage().spec_draft_tokens for r in reqs) > 0
