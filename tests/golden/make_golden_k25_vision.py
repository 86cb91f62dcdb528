#!/usr/bin/env python3
"""Generate `tests/golden/fixtures/kimi_k25_vision/`: a miniature Kimi K2.5 that sees.

    PYTHONPATH=.venv-ref/torchvision .venv-ref/bin/python tests/golden/make_golden_k25_vision.py

Reference environment as for `make_golden_k25.py` (python 3.11, torch 2.13.0+cpu, transformers
5.24.0), plus torchvision for transformers' `Kimi_K25ImageProcessor` (its only backend).
PyPI's torchvision 0.28.0 wheel is a CUDA build whose C extension does not load beside the
CPU torch; the processor needs none of it (resize, pad and normalize are torch ops), so it is
installed outside the venv and imported without its operator registrations
(`bash tests/golden/make_ref_env.sh --vision` does this):

    .venv-ref/bin/pip install --no-deps --target .venv-ref/torchvision torchvision==0.28.0

Deterministic (fixed seeds, integer-made images), CPU, a few seconds. What it makes:
1. transformers' own `Kimi_K25ForConditionalGeneration`: the text model of `kimi_k25_int4`
   (float here, no quantization), a 2-layer vision tower (hidden 32, 2 heads of 16, MLP 64,
   the real patch 14 and 2x2 merge, a 6x6 position table, so 8-patch-wide grids upsample it
   and small ones downsample it), weights redrawn at unit scale (text as `make_golden.reinit_`).
2. `save_pretrained`, renamed to the hub's tensor names (`make_golden_k25.hub_name`, and the
   patch embedding `vision_tower.patch_embed.proj.*`), one `model.safetensors`; transformers
   reloads the directory and every parameter must equal the built model's (this checks the
   names and the fused, rope-permuted `wqkv`).
3. `preprocessor_config.json` (transformers' processor, max_patches 40, at most 8 patches a
   side) and a Kimi tokenizer: `tiktoken.model` with the 256 byte ranks only and Kimi's
   special table after them (so <|media_pad|> is 256 + 21 = 277; config.json's image_token_id).
4. `golden.npz` (compressed), from the reloaded model in float32 (eager attention):
   `pixel_values_{i}` / `grid_thw_{i}`: the processor's output for `vision_images.make_image(i)`;
   `image_features` [sum of tokens, 64]: `get_image_features` of all 8 images in one call,
   `image_tokens` [8] (tokens per image); for prompts j = 0 (image 4) and 1 (images 2 and 3):
   `prompt_{j}` (a K2.5 chat turn, each image as <|media_begin|>image<|media_content|>
   <|media_pad|> x n <|media_end|>), `prompt_images_{j}`, `prefill_logits_{j}`, `greedy_{j}`
   (32 tokens), `decode_logits_{j}` (31 cached decode steps after the multimodal prefill).
   Seeds are retried until every greedy choice has a top-2 margin >= 0.02, every routing
   decision a gap >= 2e-4, and no greedy token is a media token.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.dont_write_bytecode = True
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
# torchvision without its C extension (see the docstring): only its pure-torch transforms run.
for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.kimi_k25.image_processing_kimi_k25 import (  # noqa: E402
    Kimi_K25ImageProcessor)

from golden_cases import EXPECTED_TRANSFORMERS, MIN_GREEDY_MARGIN, MIN_ROUTER_GAP, N_GREEDY  # noqa: E402
from golden_quality import RouterMonitor, top2_margin  # noqa: E402
from make_golden import case_seed, reinit_  # noqa: E402
from make_golden_k25 import TEXT_CONFIG, _TextView, hub_name, read_dir  # noqa: E402
from vision_images import IMAGE_CASES, make_image  # noqa: E402

NAME = "kimi_k25_vision"
OUT = HERE / "fixtures" / NAME
N_BYTES = 256  # tiktoken ranks: the bytes only, so a byte's token id is its value
# Kimi K2.5's special tokens: offset after the ranks -> (content, special flag), as its
# tokenizer_config.json's added_tokens_decoder has them (ids 163584 + offset there).
KIMI_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True), 6: ("<|start_header_id|>", True),
    7: ("<|end_header_id|>", True), 9: ("[EOT]", True), 10: ("<|im_system|>", True),
    11: ("<|tool_calls_section_begin|>", False), 12: ("<|tool_calls_section_end|>", False),
    13: ("<|tool_call_begin|>", False), 14: ("<|tool_call_argument_begin|>", False),
    15: ("<|tool_call_end|>", False), 17: ("<|im_middle|>", True), 18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True), 20: ("<|media_end|>", True), 21: ("<|media_pad|>", True),
    22: ("<think>", True), 23: ("</think>", True),
}
SPECIAL = {name: N_BYTES + k for k, (name, _) in KIMI_SPECIALS.items()}
MEDIA_PAD = SPECIAL["<|media_pad|>"]
VIDEO_PAD = 319  # transformers' video placeholder id must lie in the vocabulary; never used

VISION_CONFIG = dict(patch_size=14, pos_emb_height=6, pos_emb_width=6, pos_emb_time=2,
                     num_attention_heads=2, num_hidden_layers=2, hidden_size=32,
                     intermediate_size=64, merge_kernel_size=[2, 2])
PROCESSOR = dict(max_patches=40, size={"max_height": 8, "max_width": 8})
PROMPT_IMAGES = [[4], [2, 3]]
PROMPT_TEXTS = ["What is in this picture?", "Compare the first image with the second one."]


def build(seed: int):
    torch.manual_seed(seed)
    text = dict(TEXT_CONFIG, bos_token_id=SPECIAL["[BOS]"], eos_token_id=SPECIAL["[EOS]"])
    cfg = Kimi_K25Config(text_config=text, vision_config=dict(VISION_CONFIG),
                         projection_hidden_size=VISION_CONFIG["hidden_size"],
                         tie_word_embeddings=False, image_token_id=MEDIA_PAD,
                         video_token_id=VIDEO_PAD)
    model = Kimi_K25ForConditionalGeneration._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
    model.eval()
    reinit_(_TextView(model), dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0), seed)
    reinit_vision_(model, seed + 1)
    return model


@torch.no_grad()
def reinit_vision_(model, seed: int) -> None:
    """Unit-scale weights for the tower and projector (their default init is near zero)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not name.startswith(("model.vision_tower.", "model.mm_projector.")):
            continue
        r = torch.randn(*p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("position_embeddings"):
            p.copy_(0.5 * r)
        elif "norm" in name and name.endswith(".weight"):
            p.copy_(1.0 + 0.1 * r)
        elif name.endswith(".bias"):
            p.copy_(0.1 * r)
        elif p.ndim >= 2:  # Linear [out, in] or the patch conv [D, 3, p, p]
            p.copy_(r / math.sqrt(p[0].numel()))
        else:
            raise RuntimeError(f"reinit_vision_: unhandled parameter {name} {tuple(p.shape)}")


def hub_vision_name(n: str) -> str:
    n = hub_name(n)
    return n.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")


def write_tokenizer(case_dir: Path) -> None:
    with open(case_dir / "tiktoken.model", "w") as fh:
        for b in range(N_BYTES):
            fh.write(f"{base64.b64encode(bytes([b])).decode()} {b}\n")
    config = {"added_tokens_decoder": {
        str(N_BYTES + k): {"content": name, "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False, "special": special}
        for k, (name, special) in KIMI_SPECIALS.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer"}
    (case_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_fixture(model, case_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        raw = read_dir(Path(tmp))
        cfg = json.loads((Path(tmp) / "config.json").read_text())
    tensors = {hub_vision_name(k): v.contiguous() for k, v in raw.items()}
    assert len(tensors) == len(raw)
    assert "vision_tower.patch_embed.proj.weight" in tensors, sorted(tensors)[:8]
    save_file(tensors, str(case_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]
    cfg["text_config"]["model_type"] = "kimi_k2"
    cfg["dtype"] = cfg["text_config"]["dtype"] = "float32"
    (case_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    Kimi_K25ImageProcessor(**PROCESSOR).save_pretrained(str(case_dir))
    write_tokenizer(case_dir)


def load_reference(case_dir: Path, built):
    """transformers' model of the fixture; every parameter equal to the built model's."""
    m = Kimi_K25ForConditionalGeneration.from_pretrained(
        str(case_dir), attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32)
    m.eval()
    want = dict(built.named_parameters())
    got = dict(m.named_parameters())
    assert want.keys() == got.keys(), sorted(set(want) ^ set(got))[:8]
    for n, p in want.items():
        assert torch.equal(p, got[n]), f"{n} differs after the hub-named reload"
    return m


def prompt_ids(text: str, n_tokens: list[int]) -> np.ndarray:
    """A K2.5 user turn with the images first, then the text; the generation prompt opens
    the assistant's reasoning."""
    s = SPECIAL
    ids = [s["<|im_user|>"], *b"user", s["<|im_middle|>"]]
    for n in n_tokens:
        ids += [s["<|media_begin|>"], *b"image", s["<|media_content|>"], *[MEDIA_PAD] * n,
                s["<|media_end|>"]]
    ids += [*text.encode(), s["<|im_end|>"], s["<|im_assistant|>"], *b"assistant",
            s["<|im_middle|>"], s["<think>"]]
    return np.array(ids, np.int32)


@torch.no_grad()
def run_mm_prompt(model, prompt: np.ndarray, pixel_values, grid_thw):
    """Prefill with the images, then greedy-decode N_GREEDY tokens through a DynamicCache."""
    ids = torch.tensor(prompt[None, :], dtype=torch.long)
    cache = DynamicCache(config=model.config.text_config)
    out = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid_thw, cache=cache,
                use_cache=True)
    prefill = out.logits[0].float()
    greedy = [int(prefill[-1].argmax())]
    margins = [float(top2_margin(prefill[-1]))]
    decode = []
    for _ in range(N_GREEDY - 1):
        out = model(input_ids=torch.tensor([[greedy[-1]]]), cache=cache, use_cache=True)
        step = out.logits[0, -1].float()
        decode.append(step)
        greedy.append(int(step.argmax()))
        margins.append(float(top2_margin(step)))
    assert cache.get_seq_length() == len(prompt) + N_GREEDY - 1
    return dict(prefill=prefill.numpy().astype(np.float32),
                decode=torch.stack(decode).numpy().astype(np.float32),
                greedy=np.array(greedy, np.int32), margins=np.array(margins))


def processed(proc, indices):
    out = proc(images=[make_image(i) for i in indices], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def main() -> None:
    tv = ".".join(transformers.__version__.split(".")[:2])
    if tv != EXPECTED_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__} != {EXPECTED_TRANSFORMERS}.x")
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    proc = Kimi_K25ImageProcessor(**PROCESSOR)
    images = [processed(proc, [i]) for i in range(len(IMAGE_CASES))]
    every = processed(proc, range(len(IMAGE_CASES)))
    assert torch.equal(every[0], torch.cat([pv for pv, _ in images]))  # per image, in order
    n_tok = [int(g.prod()) // 4 for _, g in images]
    prompts = [prompt_ids(t, [n_tok[i] for i in idx]) for t, idx in zip(PROMPT_TEXTS, PROMPT_IMAGES)]
    for attempt in range(20):
        seed = case_seed(NAME, attempt)
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        built = build(seed)
        write_fixture(built, OUT)
        ref = load_reference(OUT, built)
        mon = RouterMonitor(ref)
        runs = [run_mm_prompt(ref, p, torch.cat([images[i][0] for i in idx]),
                              torch.cat([images[i][1] for i in idx]))
                for p, idx in zip(prompts, PROMPT_IMAGES)]
        gap = mon.min_gap()
        mon.remove()
        margin = min(float(r["margins"].min()) for r in runs)
        media = any(set(r["greedy"].tolist()) & {MEDIA_PAD, VIDEO_PAD} for r in runs)
        uniq = [len(set(r["greedy"].tolist())) for r in runs]
        print(f"attempt {attempt} seed {seed}: min greedy margin {margin:.4f}, "
              f"min router gap {gap:.2e}, unique greedy {uniq}, media token generated {media}")
        if margin >= MIN_GREEDY_MARGIN and gap >= MIN_ROUTER_GAP and not media and min(uniq) >= 6:
            break
    else:
        sys.exit("no acceptable seed")
    feats = ref.model.get_image_features(pixel_values=every[0], image_grid_thw=every[1]).pooler_output
    arrays = {"image_features": torch.cat(feats).numpy().astype(np.float32),
              "image_tokens": np.array(n_tok, np.int32)}
    assert [f.shape[0] for f in feats] == n_tok
    for i, (pv, g) in enumerate(images):
        arrays[f"pixel_values_{i}"] = pv.numpy().astype(np.float32)
        arrays[f"grid_thw_{i}"] = g.numpy().astype(np.int32)
    for j, (p, r) in enumerate(zip(prompts, runs)):
        arrays[f"prompt_{j}"] = p
        arrays[f"prompt_images_{j}"] = np.array(PROMPT_IMAGES[j], np.int32)
        arrays[f"prefill_logits_{j}"] = r["prefill"]
        arrays[f"greedy_{j}"] = r["greedy"]
        arrays[f"decode_logits_{j}"] = r["decode"]
    np.savez_compressed(OUT / "golden.npz", **arrays)
    meta = dict(generator="tests/golden/make_golden_k25_vision.py", seed=seed, attempt=attempt,
                min_greedy_choice_margin=margin, min_router_selection_gap=gap,
                media_pad_token_id=MEDIA_PAD, image_cases=[list(c) for c in IMAGE_CASES],
                image_tokens=n_tok, prompt_images=PROMPT_IMAGES,
                versions=dict(torch=torch.__version__, torchvision=torchvision.__version__,
                              transformers=transformers.__version__,
                              cpu_capability=torch.backends.cpu.get_cpu_capability(),
                              python=sys.version.split()[0]))
    (OUT / "GENERATED.json").write_text(json.dumps(meta, indent=2) + "\n")
    for f in OUT.iterdir():
        f.chmod(0o644)
    print(f"wrote {OUT}: {sorted(p.name for p in OUT.iterdir())}, "
          f"{sum(p.stat().st_size for p in OUT.iterdir()) / 1e3:.0f} KB")


if __name__ == "__main__":
    main()
