#!/usr/bin/env python3
"""Generate `tests/golden/fixtures/kimi_k25_int4/`: a miniature Kimi K2.5 as it ships.

    .venv-ref/bin/python tests/golden/make_golden_k25.py

Reference environment as for `make_golden.py` (python 3.11, torch 2.13.0+cpu, transformers
5.24.0) plus `compressed-tensors==0.20.1`; `bash tests/golden/make_ref_env.sh` builds it.
Deterministic (fixed seeds), CPU, a few seconds.

What it makes, step by step:
1. transformers' own `Kimi_K25ForConditionalGeneration` (tiny random dims, a vision tower and
   projector present, untied head), text weights redrawn as `make_golden.reinit_` does.
2. `save_pretrained`, then the hub's tensor names: transformers 5.24 writes
   `language_model.model.blocks.N.*` and `model.mm_projector.*`; the hub has
   `language_model.model.layers.N.*` and `mm_projector.*`.
3. The routed experts compressed by the `compressed-tensors` library itself: the modules its
   `is_match` selects with the checkpoint's quantization_config (targets `Linear`; ignore
   `lm_head`, `re:.*self_attn.*`, `re:.*shared_experts.*`, `re:.*mlp\\.(gate|up|gate_up|down)_proj.*`,
   plus the vision tower and projector, kept float here), weights cast to bf16 as the real
   model's are, group-32 symmetric INT4 scales from the library's `calculate_qparams` (min/max
   per group, bf16), then `PackedQuantizationCompressor.compress` (its `quantize` and
   `pack_to_int32`): `weight_packed` int32 [out, in/8], `weight_scale` bf16 [out, in/32],
   `weight_shape` int32 [2]. Everything else stays float32 (so the parity check is float32).
4. Written as 4 shards with a `model.safetensors.index.json` (a layer's experts spread over
   shards); `quantization_config` inside `text_config` (as the hub has it), `text_config`'s
   model_type `kimi_k2` (the hub's value; transformers maps it to deepseek_v3).
5. The golden: transformers loads the directory (from a copy whose quantization_config sits at
   the top level, where transformers looks) and decompresses the experts with
   compressed-tensors: W = (nibble - 8).to(bf16) * scale, a bf16 product, then float32. Its
   logits and greedy tokens for the two prompts of `make_golden` (prefill, 31 cached decode
   steps) go to `golden.npz`, in the same keys as the other fixtures. The script checks that
   the loaded expert weights equal compressed-tensors' `decompress` of the stored tensors
   bitwise, and that a seed's greedy choices and routing decisions are not near-ties.
6. `unpack_cases.npz`: hand-checkable packing cases for the engine's unpack test: random int4
   matrices [rows, cols] and what `pack_to_int32` makes of them.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.dont_write_bytecode = True
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import compressed_tensors  # noqa: E402
import transformers  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402
from compressed_tensors.utils.match import is_match  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration  # noqa: E402

from golden_cases import EXPECTED_TRANSFORMERS, MIN_GREEDY_MARGIN, MIN_ROUTER_GAP, N_GREEDY  # noqa: E402
from golden_quality import RouterMonitor  # noqa: E402
from make_golden import case_seed, make_prompts, reinit_, run_prompt  # noqa: E402

NAME = "kimi_k25_int4"
OUT = HERE / "fixtures" / NAME
N_SHARDS = 4
GROUP = 32

TEXT_CONFIG = dict(
    model_type="deepseek_v3", vocab_size=320, hidden_size=64, intermediate_size=32,
    moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
    norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_position_embeddings=256, tie_word_embeddings=False, num_nextn_predict_layers=0,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6, hidden_act="silu",
    rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=4.0, beta_fast=32,
                         beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                         original_max_position_embeddings=64),
)
VISION_CONFIG = dict(patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
                     num_attention_heads=2, num_hidden_layers=1, hidden_size=16,
                     intermediate_size=32, merge_kernel_size=[2, 2])
WEIGHTS = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP,
               dynamic=False, actorder=None, observer="minmax", observer_kwargs={},
               block_structure=None)
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
          r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
# Not in the hub's list: kept float in this fixture (the engine skips vision tensors whatever
# their format until the vision tower exists).
IGNORE_FIXTURE = IGNORE + ["re:.*vision_tower.*", "re:.*mm_projector.*"]
QUANT_CONFIG = dict(
    quant_method="compressed-tensors", format="pack-quantized",
    quantization_status="compressed", kv_cache_scheme=None, ignore=IGNORE_FIXTURE,
    config_groups=dict(group_0=dict(targets=["Linear"], weights=WEIGHTS,
                                    input_activations=None, output_activations=None,
                                    format="pack-quantized")),
)


class _TextView:
    """The text model's parameters under DeepseekV3ForCausalLM's names, for `reinit_`."""

    def __init__(self, model):
        self.model, self.config = model, model.config.text_config

    @staticmethod
    def _rename(n):
        return n.replace("model.language_model.", "model.")

    def named_parameters(self):
        return [(self._rename(n), p) for n, p in self.model.named_parameters()
                if n.startswith("model.language_model.") or n == "lm_head.weight"]

    def named_buffers(self):
        return [(self._rename(n), b) for n, b in self.model.named_buffers()
                if n.startswith("model.language_model.")]


def build(seed: int):
    torch.manual_seed(seed)
    cfg = Kimi_K25Config(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG),
                         projection_hidden_size=VISION_CONFIG["hidden_size"],
                         tie_word_embeddings=False)
    model = Kimi_K25ForConditionalGeneration._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
    model.eval()
    reinit_(_TextView(model), dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0), seed)
    return model


def hub_name(n: str) -> str:
    n = n.replace("language_model.model.blocks.", "language_model.model.layers.")
    if n.startswith("model.mm_projector."):
        n = n[len("model."):]
    return n


def int4_scheme() -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**WEIGHTS))


def compress_weight(w: torch.Tensor, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized tensors of one [out, in] weight (bf16, group 32)."""
    w = w.to(torch.bfloat16)
    out, inp = w.shape
    g = w.reshape(out, inp // GROUP, GROUP)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    sd = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert set(sd) == {"weight_packed", "weight_scale", "weight_shape"}, sorted(sd)
    assert sd["weight_packed"].dtype == torch.int32 and sd["weight_scale"].dtype == torch.bfloat16
    return {k: v.contiguous() for k, v in sd.items()}


def read_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def write_fixture(model, case_dir: Path) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        raw = read_dir(Path(tmp))
        cfg = json.loads((Path(tmp) / "config.json").read_text())
    tensors = {hub_name(k): v for k, v in raw.items()}
    assert len(tensors) == len(raw)
    assert not any(".blocks." in k for k in tensors if k.startswith("language_model."))
    scheme = int4_scheme()
    out: dict[str, torch.Tensor] = {}
    compressed = []
    for name, t in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        # Every 2-D `.weight` of the hub layout except embeddings, norms and the router is an
        # nn.Linear's (the per-expert modules included).
        linear = (module is not None and t.ndim == 2 and not name.endswith("embed_tokens.weight")
                  and not name.endswith("mlp.gate.weight") and "pos_emb" not in name)
        # The ignore list names the text model's modules ("lm_head", not
        # "language_model.lm_head": the hub's list was written for the text model's names).
        text_name = module.removeprefix("language_model.") if module else None
        if linear and is_match(text_name, torch.nn.Linear(1, 1), ["Linear"], IGNORE_FIXTURE):
            for k, v in compress_weight(t, scheme).items():
                out[f"{module}.{k}"] = v
            compressed.append(module)
        else:
            out[name] = t.contiguous()
    assert compressed and all(".mlp.experts." in m for m in compressed), compressed
    n_moe = TEXT_CONFIG["num_hidden_layers"] - TEXT_CONFIG["first_k_dense_replace"]
    assert len(compressed) == 3 * n_moe * TEXT_CONFIG["n_routed_experts"]

    # Shards: the float tensors in name order in shards of about equal bytes; expert e's
    # tensors spread round-robin, its weight_scale in the shard after its weight_packed.
    names = sorted(out)
    expert = re.compile(r".*\.mlp\.experts\.(\d+)\.\w+\.(weight_\w+)$")
    plain = [n for n in names if not expert.match(n)]
    total = sum(out[n].numel() * out[n].element_size() for n in names)
    plain_total = sum(out[n].numel() * out[n].element_size() for n in plain)
    shards: list[list[str]] = [[] for _ in range(N_SHARDS)]
    acc = 0
    for n in plain:
        shards[min(int(acc * N_SHARDS / plain_total), N_SHARDS - 1)].append(n)
        acc += out[n].numel() * out[n].element_size()
    for n in names:
        m = expert.match(n)
        if m:
            shards[(int(m.group(1)) + (m.group(2) != "weight_packed")) % N_SHARDS].append(n)
    weight_map = {}
    for i, group in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: out[n] for n in group}, str(case_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    (case_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")

    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]
    cfg["text_config"]["model_type"] = "kimi_k2"
    cfg["text_config"]["quantization_config"] = QUANT_CONFIG
    cfg["dtype"] = cfg["text_config"]["dtype"] = "float32"
    (case_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return weight_map


def load_reference(case_dir: Path):
    """transformers' model of the fixture, experts decompressed by compressed-tensors."""
    with tempfile.TemporaryDirectory() as tmp:
        for f in case_dir.iterdir():
            shutil.copy(f, tmp)
        cfg = json.loads((Path(tmp) / "config.json").read_text())
        # dequantize=True: decompressed at load (else compressed-tensors would run the packed
        # modules itself, which the stacked experts are not).
        cfg["quantization_config"] = dict(cfg["text_config"].pop("quantization_config"),
                                          dequantize=True)
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        m = Kimi_K25ForConditionalGeneration.from_pretrained(
            tmp, attn_implementation="eager", experts_implementation="eager",
            dtype=torch.float32)
    # transformers keeps the decompressed experts in the scale's dtype (bf16, the library's
    # product); the golden is computed in float32 from exactly those values.
    kept_bf16 = sorted({n.split(".mlp.")[-1] for n, p in m.named_parameters()
                        if p.dtype == torch.bfloat16})
    print(f"  bf16 after load (cast to float32 for the golden): {kept_bf16}")
    m = m.float()
    m.eval()
    return m


def check_decompressed(ref, case_dir: Path) -> None:
    """The reference's expert weights are compressed-tensors' decompression, bitwise."""
    stored = read_dir(case_dir)
    scheme = int4_scheme()
    sd = dict(ref.named_parameters())
    n_checked = 0
    for layer in range(TEXT_CONFIG["first_k_dense_replace"], TEXT_CONFIG["num_hidden_layers"]):
        pre = f"model.language_model.layers.{layer}.mlp.experts."
        gate_up, down = sd[pre + "gate_up_proj"], sd[pre + "down_proj"]
        assert gate_up.dtype == torch.float32
        im = TEXT_CONFIG["moe_intermediate_size"]
        for e in range(TEXT_CONFIG["n_routed_experts"]):
            for proj, got in (("gate_proj", gate_up[e, :im]), ("up_proj", gate_up[e, im:]),
                              ("down_proj", down[e])):
                h = f"language_model.model.layers.{layer}.mlp.experts.{e}.{proj}."
                w = PackedQuantizationCompressor.decompress(
                    {k: stored[h + k] for k in ("weight_packed", "weight_scale", "weight_shape")},
                    scheme)["weight"]
                assert w.dtype == torch.bfloat16, w.dtype
                assert torch.equal(got, w.to(torch.float32)), h
                n_checked += 1
    print(f"  {n_checked} expert matrices: transformers' weights == compressed-tensors "
          f"decompress (bf16 product) bitwise")


def unpack_cases(path: Path) -> None:
    rng = np.random.default_rng(31)
    arrays = {}
    for i, (rows, cols) in enumerate([(3, 8), (5, 64), (2, 96)]):
        q = rng.integers(-8, 8, size=(rows, cols)).astype(np.int8)
        q[0, :8] = [-8, -1, 0, 1, 7, 3, -5, 6]  # a hand-checkable first word
        arrays[f"values_{i}"] = q
        arrays[f"packed_{i}"] = pack_to_int32(torch.from_numpy(q), 4).numpy()
    np.savez(path, **arrays)


def main() -> None:
    tv = ".".join(transformers.__version__.split(".")[:2])
    if tv != EXPECTED_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__} != {EXPECTED_TRANSFORMERS}.x")
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    prompts = make_prompts()
    for attempt in range(20):
        seed = case_seed(NAME, attempt)
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        write_fixture(build(seed), OUT)
        ref = load_reference(OUT)
        mon = RouterMonitor(ref)
        runs = [run_prompt(ref, p) for p in prompts]
        gap = mon.min_gap()
        mon.remove()
        margin = min(float(r["choice_margins"].min()) for r in runs)
        uniq = [len(set(r["greedy"].tolist())) for r in runs]
        print(f"attempt {attempt} seed {seed}: min greedy margin {margin:.4f}, "
              f"min router gap {gap:.2e}, unique greedy {uniq}")
        if margin >= MIN_GREEDY_MARGIN and gap >= MIN_ROUTER_GAP and min(uniq) >= 6:
            break
    else:
        sys.exit("no acceptable seed")
    check_decompressed(ref, OUT)
    arrays = {}
    for i, (p, r) in enumerate(zip(prompts, runs)):
        arrays[f"prompt_{i}"] = p.astype(np.int32)
        arrays[f"prefill_logits_{i}"] = r["prefill"].astype(np.float32)
        arrays[f"greedy_{i}"] = r["greedy"].astype(np.int32)
        arrays[f"decode_logits_{i}"] = r["decode"].astype(np.float32)
        assert arrays[f"decode_logits_{i}"].shape[0] == N_GREEDY - 1
    np.savez(OUT / "golden.npz", **arrays)
    unpack_cases(OUT / "unpack_cases.npz")
    meta = dict(generator="tests/golden/make_golden_k25.py", seed=seed, attempt=attempt,
                min_greedy_choice_margin=margin, min_router_selection_gap=gap,
                versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                              compressed_tensors=compressed_tensors.__version__,
                              python=sys.version.split()[0]),
                dequant="W = (nibble - 8).to(bf16) * weight_scale (bf16 product), then float32")
    (OUT / "GENERATED.json").write_text(json.dumps(meta, indent=2) + "\n")
    for f in OUT.iterdir():
        f.chmod(0o644)
    print(f"wrote {OUT}: {sorted(p.name for p in OUT.iterdir())}, "
          f"{sum(p.stat().st_size for p in OUT.iterdir()) / 1e3:.0f} KB")


if __name__ == "__main__":
    main()
