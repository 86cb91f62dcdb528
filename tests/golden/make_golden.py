#!/usr/bin/env python3
"""Generate the Hugging Face golden fixtures under ``tests/golden/fixtures/``.

The moejax JAX model tests load each fixture directory (HF ``config.json`` +
safetensors weights + ``tokenizer.json``) into the JAX engine and compare its
prefill / decode logits and greedy tokens against the reference numbers stored
in ``golden.npz``, which this script computes with Hugging Face transformers
(PyTorch, float32, eager attention, CPU).  The fixture format is documented in
``tests/golden/README.md``; a machine-readable list of the cases is written to
``tests/golden/fixtures/MANIFEST.json``.

Reference environment (this is what the committed fixtures were made with)
---------------------------------------------------------------------------
    bash tests/golden/make_ref_env.sh      # -> .venv-ref/ at the repository root
    # python3.11 -m venv .venv-ref, then ``pip install torch==2.13.0`` (the CPU build:
    # TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where pip would take CUDA's) and
    # ``transformers==5.24.0 compressed-tensors==0.20.1 safetensors numpy tokenizers tiktoken``
    # (used: torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3, numpy 2.4.6)

The script refuses to run with a different transformers major/minor version
unless ``--allow-other-versions`` is given, because the tiny models' configs and
module internals (router, YaRN, MLA layout) are version specific.

How to run
----------
From the repository root::

    .venv-ref/bin/python tests/golden/make_golden.py            # all cases
    .venv-ref/bin/python tests/golden/make_golden.py --cases llama qwen3

It needs no network and no GPU (about 10 seconds on CPU).  Each case
directory is deleted and rewritten; MANIFEST.json is rewritten from the cases
generated in this run plus (when ``--cases`` is used) the entries already in the
manifest for the other cases.  At the end every generated case is re-checked
against ``tests/golden/numpy_reference.py`` (an independent float64 NumPy
implementation that reads only config.json + safetensors).

Files
-----
  * ``make_golden.py`` (this script, the driver): tokenizer, model init, prefill/decode
    runs, writing the fixtures and MANIFEST.json, ``main``.
  * ``golden_cases.py``: constants, quality thresholds and the per-case configs (``CASES``).
  * ``golden_quality.py``: logit margins, router gaps (``RouterMonitor``), ablations.
The helpers are plain sibling modules (no package); the script puts its folder on sys.path.

Determinism
-----------
All randomness comes from fixed seeds: the prompts from ``PROMPT_SEED``, and each
model's weights from a ``torch.Generator`` seeded with ``crc32(case name) +
1000 * attempt``.  ``attempt`` starts at 0 and is only increased if a
candidate model fails the quality checks below (peaked logits, non-degenerate
greedy output, no near-tie in routing / greedy choices, every component
matters); the attempt actually used is recorded in MANIFEST.json.  Re-running
the script reproduces the same weights bit-for-bit and the same logits up to
float32 CPU kernel noise (~1e-6).

Why the weights are re-initialized
----------------------------------
HF's default init (normal std 0.02) gives near-uniform logits, so greedy
comparisons would be meaningless.  We re-draw every parameter:
  * Linear weights ~ N(0, gain^2 / fan_in)   (expert tensors: per-expert fan_in)
  * embeddings ~ N(0, 1); untied lm_head ~ N(0, lm_gain^2 / hidden)
  * RMSNorm weights = 1 + 0.1 * N(0, 1) (input/post-attn/final/q_a/kv_a/q/k norms)
  * router weights ~ N(0, router_gain^2 / hidden)
  * DeepSeek-V3 ``e_score_correction_bias`` ~ N(0, 0.15^2) (nonzero, changes routing)
For tied-embedding models the input embedding would dominate the residual stream and
greedy decoding would just repeat the last token, so there attention/MLP gains are 2.0
and the final norm weight is multiplied by 1.5 (see ``gains`` in CASES).  The goal is
that logits are peaked (mean top1-top2 margin of several units), hidden
states stay O(1) and each component measurably changes the logits (checked by
ablation; numbers printed and stored in MANIFEST.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

import transformers
from transformers import GenerationConfig
from transformers.cache_utils import DynamicCache

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"

# Sibling modules (this is a script, not a package): make its own folder importable no matter
# how it is started, and keep tests/golden free of __pycache__.
sys.dont_write_bytecode = True
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from golden_cases import (  # noqa: E402
    BOS_ID,
    BYTE_OFFSET,
    CASES,
    EOS_ID,
    EXPECTED_TRANSFORMERS,
    MAX_ATTEMPTS,
    MIN_ABLATION_EFFECT,
    MIN_GREEDY_MARGIN,
    MIN_MEAN_MARGIN,
    MIN_ROUTER_GAP,
    MIN_UNIQUE_GREEDY,
    N_GREEDY,
    PAD_ID,
    PROMPT_LENS,
    PROMPT_SEED,
    ROUNDTRIP_TEXT,
    SKIPPED,
    VOCAB,
)
from golden_quality import RouterMonitor, ablation_effects, top2_margin  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode char map (the alphabet of tokenizers' ByteLevel)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    for b in range(256):
        vocab[b2u[b]] = BYTE_OFFSET + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<s>", "</s>")]
    )
    # verify
    ids = tok.encode(ROUNDTRIP_TEXT).ids
    assert ids == [b + BYTE_OFFSET for b in ROUNDTRIP_TEXT.encode("utf-8")], ids
    assert tok.decode(ids) == ROUNDTRIP_TEXT, repr(tok.decode(ids))
    ids2 = tok.encode("<s>héllo ✓</s>").ids
    assert ids2[0] == BOS_ID and ids2[-1] == EOS_ID, ids2
    assert tok.decode(ids2, skip_special_tokens=True) == "héllo ✓"
    assert tok.token_to_id("<pad>") == PAD_ID and tok.token_to_id("<s>") == BOS_ID
    assert tok.get_vocab_size() == 259
    return tok


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 256,
}


def check_tokenizer_with_transformers(case_dir: Path):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(case_dir))
    ids = t(ROUNDTRIP_TEXT, add_special_tokens=True)["input_ids"]
    assert ids == [b + BYTE_OFFSET for b in ROUNDTRIP_TEXT.encode("utf-8")], ids
    assert t.decode(ids) == ROUNDTRIP_TEXT
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)


# ----------------------------------------------------------------------------------------------
# Model construction / init
# ----------------------------------------------------------------------------------------------


def case_seed(name: str, attempt: int) -> int:
    return (zlib.crc32(name.encode()) + 1000 * attempt) % (2**31)


def build_model(case: dict, seed: int):
    torch.manual_seed(seed)
    config = case["config_cls"](**copy.deepcopy(case["config"]))
    model = case["model_cls"]._from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    model.eval()
    reinit_(model, case["gains"], seed)
    return model


def _randn(gen, shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


@torch.no_grad()
def reinit_(model, gains: dict, seed: int):
    """Deterministically overwrite every parameter (and the DSV3 correction bias buffer)."""
    gen = torch.Generator().manual_seed(seed)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    handled = set()
    # named_parameters() de-duplicates tied tensors: lm_head.weight only appears when untied.
    for name, p in model.named_parameters():
        leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
        if name.endswith("embed_tokens.weight"):
            p.copy_(_randn(gen, p.shape))
        elif name == "lm_head.weight":
            assert not tied
            p.copy_(_randn(gen, p.shape) * (gains["lm"] / math.sqrt(p.shape[1])))
        elif name == "model.norm.weight":  # final norm; scaled up for tied models to sharpen logits
            p.copy_((1.0 + 0.1 * _randn(gen, p.shape)) * gains.get("final_norm", 1.0))
        elif p.ndim == 1 and ("norm" in leaf):
            p.copy_(1.0 + 0.1 * _randn(gen, p.shape))
        elif name.endswith("mlp.gate.weight"):  # MoE router [E, H]
            p.copy_(_randn(gen, p.shape) * (gains["router"] / math.sqrt(p.shape[1])))
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
            p.copy_(_randn(gen, p.shape) * (gains["mlp"] / math.sqrt(p.shape[2])))
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            p.copy_(_randn(gen, p.shape) * (gains["mlp"] / math.sqrt(p.shape[2])))
        elif p.ndim == 2:  # nn.Linear [out, in]
            g = gains["attn"] if ".self_attn." in name else gains["mlp"]
            p.copy_(_randn(gen, p.shape) * (g / math.sqrt(p.shape[1])))
        elif p.ndim == 1 and name.endswith(".bias"):
            p.copy_(0.1 * _randn(gen, p.shape))
        else:
            raise RuntimeError(f"reinit_: unhandled parameter {name} {tuple(p.shape)}")
        handled.add(name)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.15 * _randn(gen, b.shape))
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# ----------------------------------------------------------------------------------------------
# Golden computation
# ----------------------------------------------------------------------------------------------


def make_prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(PROMPT_SEED)
    prompts = []
    for L in PROMPT_LENS:
        p = np.concatenate([[BOS_ID], rng.integers(BYTE_OFFSET, VOCAB, size=L - 1)]).astype(np.int32)
        prompts.append(p)
    return prompts


@torch.no_grad()
def run_prompt(model, prompt: np.ndarray):
    """Prefill the prompt, then greedy-decode N_GREEDY tokens one at a time through a DynamicCache."""
    ids = torch.tensor(prompt[None, :], dtype=torch.long)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    prefill = out.logits[0].float()  # [L, V]
    greedy = [int(prefill[-1].argmax())]
    choice_margins = [float(top2_margin(prefill[-1]))]
    decode = []
    for _ in range(N_GREEDY - 1):
        tok = torch.tensor([[greedy[-1]]], dtype=torch.long)
        out = model(input_ids=tok, cache=cache, use_cache=True)
        step = out.logits[0, -1].float()
        decode.append(step)
        greedy.append(int(step.argmax()))
        choice_margins.append(float(top2_margin(step)))
    assert cache.get_seq_length() == len(prompt) + N_GREEDY - 1
    return dict(
        prefill=prefill.numpy().astype(np.float32),
        decode=torch.stack(decode).numpy().astype(np.float32),
        greedy=np.array(greedy, dtype=np.int32),
        choice_margins=np.array(choice_margins),
    )


@torch.no_grad()
def check_generate(model, prompt: np.ndarray, greedy: np.ndarray):
    """HF generate() (greedy, EOS disabled) must reproduce the hand-rolled loop."""
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=N_GREEDY,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        num_beams=1,
        use_cache=True,
    )
    ids = torch.tensor(prompt[None, :], dtype=torch.long)
    # generate() fills every None field of the passed GenerationConfig from model.generation_config
    # (which carries eos_token_id=2 from the model config), so EOS must be cleared there as well.
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    finally:
        model.generation_config = saved
    new = out[0, ids.shape[1]:].numpy().astype(np.int32)
    assert new.shape == (N_GREEDY,), f"generate returned {new.shape[0]} new tokens (EOS not disabled?)"
    assert np.array_equal(new, greedy), f"generate {new.tolist()} != hand loop {greedy.tolist()}"


# ----------------------------------------------------------------------------------------------
# Per-case driver
# ----------------------------------------------------------------------------------------------


def evaluate_candidate(name: str, case: dict, seed: int, prompts):
    model = build_model(case, seed)
    mon = RouterMonitor(model)
    runs = [run_prompt(model, p) for p in prompts]
    min_router_gap = mon.min_gap()
    mon.remove()
    all_margins = np.concatenate(
        [top2_margin(torch.from_numpy(r["prefill"])).numpy() for r in runs]
        + [top2_margin(torch.from_numpy(r["decode"])).numpy() for r in runs]
    )
    stats = dict(
        seed=seed,
        mean_top1_top2_margin=float(all_margins.mean()),
        median_top1_top2_margin=float(np.median(all_margins)),
        min_greedy_choice_margin=float(min(r["choice_margins"].min() for r in runs)),
        min_router_selection_gap=min_router_gap,
        unique_greedy_tokens=[int(len(set(r["greedy"].tolist()))) for r in runs],
        logits_std=float(np.concatenate([r["prefill"].ravel() for r in runs]).std()),
    )
    problems = []
    if stats["mean_top1_top2_margin"] < MIN_MEAN_MARGIN:
        problems.append(f"mean margin {stats['mean_top1_top2_margin']:.3f} < {MIN_MEAN_MARGIN}")
    if stats["min_greedy_choice_margin"] < MIN_GREEDY_MARGIN:
        problems.append(f"greedy choice margin {stats['min_greedy_choice_margin']:.4f} < {MIN_GREEDY_MARGIN}")
    if min_router_gap < MIN_ROUTER_GAP:
        problems.append(f"router gap {min_router_gap:.2e} < {MIN_ROUTER_GAP}")
    if min(stats["unique_greedy_tokens"]) < MIN_UNIQUE_GREEDY:
        problems.append(f"degenerate greedy (unique={stats['unique_greedy_tokens']})")
    abl = None
    if not problems:
        abl = ablation_effects(model, prompts[1])
        weak = {k: v for k, v in abl.items() if v["rel_mean_abs_change"] < MIN_ABLATION_EFFECT}
        if weak:
            problems.append(f"components with weak effect: {weak}")
    return model, runs, stats, abl, problems


def hidden_state_rms(model, prompt) -> list[float]:
    ids = torch.tensor(prompt[None, :], dtype=torch.long)
    with torch.no_grad():
        hs = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    return [round(float(h.pow(2).mean().sqrt()), 3) for h in hs]


@torch.no_grad()
def verify_reload(case: dict, case_dir: Path, prompts, runs):
    """Reload the saved checkpoint with from_pretrained and re-check prefill + a few decode steps."""
    m = case["model_cls"].from_pretrained(
        str(case_dir), attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    m.eval()
    for p, r in zip(prompts, runs):
        ids = torch.tensor(p[None, :], dtype=torch.long)
        cache = DynamicCache(config=m.config)
        lg = m(input_ids=ids, cache=cache, use_cache=True).logits[0].float().numpy()
        np.testing.assert_allclose(lg, r["prefill"], rtol=1e-5, atol=1e-4)
        for t in range(3):
            tok = torch.tensor([[int(r["greedy"][t])]])
            lg = m(input_ids=tok, cache=cache, use_cache=True).logits[0, -1].float().numpy()
            np.testing.assert_allclose(lg, r["decode"][t], rtol=1e-5, atol=1e-4)


def describe_checkpoint(case_dir: Path) -> dict:
    from safetensors import safe_open

    files = sorted(case_dir.glob("*.safetensors"))
    names = []
    for f in files:
        with safe_open(str(f), "np") as s:
            names += list(s.keys())
    expert_names = sorted({_pattern(n) for n in names if ".experts." in n or n.endswith(("experts.gate_up_proj", "experts.down_proj"))})
    router_names = sorted({_pattern(n) for n in names if ".mlp.gate." in n})
    return dict(
        files=[f.name for f in files] + (["model.safetensors.index.json"] if (case_dir / "model.safetensors.index.json").exists() else []),
        num_tensors=len(names),
        has_lm_head=("lm_head.weight" in names),
        expert_tensor_patterns=expert_names,
        router_tensor_patterns=router_names,
    )


def _pattern(n: str) -> str:
    import re

    n = re.sub(r"layers\.\d+\.", "layers.{L}.", n)
    return re.sub(r"experts\.\d+\.", "experts.{e}.", n)


def rope_summary(model) -> dict:
    cfg = model.config
    rot = model.model.rotary_emb
    d = dict(
        rope_parameters=dict(cfg.rope_parameters),
        inv_freq=[float(x) for x in rot.inv_freq.tolist()],
        cos_sin_attention_scaling=float(rot.attention_scaling),
    )
    attn = model.model.layers[0].self_attn
    d["softmax_scaling"] = float(attn.scaling)
    if hasattr(cfg, "rope_interleave"):
        d["rope_interleave"] = bool(cfg.rope_interleave)
    return d


def generate_case(name: str, case: dict, prompts, tokenizer) -> dict:
    print(f"\n=== {name} ({case['model_cls'].__name__}) ===", flush=True)
    for attempt in range(MAX_ATTEMPTS):
        seed = case_seed(name, attempt)
        model, runs, stats, abl, problems = evaluate_candidate(name, case, seed, prompts)
        if not problems:
            break
        print(f"  attempt {attempt} (seed {seed}) rejected: {'; '.join(problems)}", flush=True)
    else:
        raise RuntimeError(f"{name}: no acceptable random init in {MAX_ATTEMPTS} attempts")
    stats["attempt"] = attempt
    stats["hidden_state_rms_per_layer(prompt_1)"] = hidden_state_rms(model, prompts[1])

    for i, (p, r) in enumerate(zip(prompts, runs)):
        check_generate(model, p, r["greedy"])
        # self-test: even when the model's own EOS is a token greedy emits early, generate() must not stop
        orig_eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = int(r["greedy"][1])
        try:
            check_generate(model, p, r["greedy"])
        finally:
            model.generation_config.eos_token_id = orig_eos
        print(f"  prompt_{i} L={len(p)} greedy={r['greedy'].tolist()}")
    print(
        f"  seed={seed} attempt={attempt} mean top1-top2 margin={stats['mean_top1_top2_margin']:.3f} "
        f"(median {stats['median_top1_top2_margin']:.3f}), min greedy-choice margin="
        f"{stats['min_greedy_choice_margin']:.4f}, min router gap={stats['min_router_selection_gap']:.2e}, "
        f"unique greedy={stats['unique_greedy_tokens']}, logits std={stats['logits_std']:.2f}"
    )
    print(f"  hidden-state rms per layer: {stats['hidden_state_rms_per_layer(prompt_1)']}")
    for k, v in abl.items():
        print(f"  ablation {k:28s} rel|dlogits|={v['rel_mean_abs_change']:.3f} argmax changed={v['argmax_changed_frac']:.2f}")

    case_dir = FIXTURES / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    save_kwargs = dict(safe_serialization=True)
    if case["sharded"]:
        save_kwargs["max_shard_size"] = "150KB"
    model.save_pretrained(str(case_dir), **save_kwargs)
    for f in case_dir.iterdir():  # safetensors files are created 0600; make the tree uniformly 0644
        f.chmod(0o644)
    if case["sharded"]:
        assert (case_dir / "model.safetensors.index.json").exists()
        assert len(list(case_dir.glob("model-*-of-*.safetensors"))) >= 3
    tokenizer.save(str(case_dir / "tokenizer.json"))
    (case_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    check_tokenizer_with_transformers(case_dir)

    arrays = {}
    for i, (p, r) in enumerate(zip(prompts, runs)):
        arrays[f"prompt_{i}"] = p.astype(np.int32)
        arrays[f"prefill_logits_{i}"] = r["prefill"].astype(np.float32)
        arrays[f"greedy_{i}"] = r["greedy"].astype(np.int32)
        arrays[f"decode_logits_{i}"] = r["decode"].astype(np.float32)
        assert arrays[f"prefill_logits_{i}"].shape == (len(p), VOCAB)
        assert arrays[f"decode_logits_{i}"].shape == (N_GREEDY - 1, VOCAB)
        assert arrays[f"greedy_{i}"][0] == r["prefill"][-1].argmax()
        assert np.array_equal(arrays[f"greedy_{i}"][1:], r["decode"].argmax(-1))
    np.savez(case_dir / "golden.npz", **arrays)

    verify_reload(case, case_dir, prompts, runs)
    ckpt = describe_checkpoint(case_dir)
    saved_cfg = json.loads((case_dir / "config.json").read_text())

    entry = dict(
        model_type=saved_cfg["model_type"],
        architecture=case["model_cls"].__name__,
        knobs=case["knobs"],
        sharded=case["sharded"],
        config_summary={
            k: saved_cfg.get(k)
            for k in (
                "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts", "num_experts_per_tok",
                "n_group", "topk_group", "topk_method", "moe_intermediate_size", "n_shared_experts",
                "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "decoder_sparse_step",
                "mlp_only_layers", "tie_word_embeddings", "rope_interleave", "rope_parameters",
            )
            if k in saved_cfg
        },
        rope=rope_summary(model),
        checkpoint=ckpt,
        quality=stats,
        ablations=abl,
        prompt_lengths=[int(len(p)) for p in prompts],
    )
    print(f"  wrote {case_dir.relative_to(HERE.parent.parent)}: {ckpt['files']}")
    return entry


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=None, help="subset of case names (default: all)")
    ap.add_argument("--allow-other-versions", action="store_true")
    args = ap.parse_args(argv)

    tv = ".".join(transformers.__version__.split(".")[:2])
    if tv != EXPECTED_TRANSFORMERS and not args.allow_other_versions:
        sys.exit(f"transformers {transformers.__version__} != {EXPECTED_TRANSFORMERS}.x used for the fixtures "
                 "(pass --allow-other-versions to override)")

    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    names = args.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"unknown cases {unknown}; known: {list(CASES)}")

    FIXTURES.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    prompts = make_prompts()
    print("prompts:", [p.tolist() for p in prompts])

    manifest_path = FIXTURES / "MANIFEST.json"
    old_cases = {}
    if args.cases and manifest_path.exists():
        old_cases = json.loads(manifest_path.read_text()).get("cases", {})

    entries = {}
    for n in names:
        entries[n] = generate_case(n, CASES[n], prompts, tokenizer)

    cases_out = {n: (entries[n] if n in entries else old_cases[n]) for n in CASES if n in entries or n in old_cases}
    manifest = dict(
        generator="tests/golden/make_golden.py",
        versions=dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            numpy=np.__version__,
            tokenizers=__import__("tokenizers").__version__,
            python=sys.version.split()[0],
        ),
        dtype="float32",
        attn_implementation="eager",
        experts_implementation="eager",
        vocab_size=VOCAB,
        special_tokens=dict(pad=PAD_ID, bos=BOS_ID, eos=EOS_ID),
        tokenizer=dict(
            kind="byte-level BPE, no merges",
            byte_token_ids="token id = byte value + 3 (3..258); ids 259..319 unused",
            adds_bos=False,
            roundtrip_text=ROUNDTRIP_TEXT,
        ),
        prompt_lengths=list(PROMPT_LENS),
        n_greedy=N_GREEDY,
        golden_keys={
            "prompt_{i}": "int32 [L_i]",
            "prefill_logits_{i}": "float32 [L_i, 320]",
            "greedy_{i}": f"int32 [{N_GREEDY}]",
            "decode_logits_{i}": f"float32 [{N_GREEDY - 1}, 320]",
        },
        skipped=SKIPPED,
        cases=cases_out,
    )
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"\nwrote {manifest_path.relative_to(HERE.parent.parent)} with {len(cases_out)} cases")

    # Independent cross-check: float64 NumPy re-implementation (no torch) must reproduce the goldens.
    # (HERE is on sys.path and bytecode writing is off: see the sibling imports at the top.)
    import numpy_reference

    for n in names:
        err = numpy_reference.check_case(FIXTURES / n)
        print(f"numpy_reference {n:22s} OK (max abs diff {err:.1e})")


if __name__ == "__main__":
    main()
