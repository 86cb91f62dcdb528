"""`summary.md` of a GPU protocol run: markdown tables from `$OUT/results.jsonl`
(`bench/gpu_check.sh` writes it, then prints this last: only the end of a device call's output
comes back, so the summary stays under 10,000 characters).

    python -m bench.summarize OUT_DIR > summary.md
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

from bench.protocol.rows import read_rows

LIMIT = 9500  # characters: the device tool returns the last ~10,000 of the output


def _f(v: Any, digits: int = 3) -> str:
  if v is None or v == "":
    return "-"
  if isinstance(v, bool):
    return str(v)
  if isinstance(v, float):
    return f"{v:.{digits}g}" if abs(v) < 1e5 else f"{v:.3e}"
  return str(v)


def _pct(v: Any) -> str:
  return "-" if v is None else f"{100 * v:.0f}%"


MAX_ROWS = 24  # per table


def table(rows: list[dict], cols: list[tuple[str, Callable[[dict], Any]]],
          max_rows: int = MAX_ROWS) -> str:
  lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
  for r in rows[:max_rows]:
    lines.append("| " + " | ".join(str(fn(r)) for _, fn in cols) + " |")
  if len(rows) > max_rows:
    lines.append(f"({len(rows) - max_rows} more rows in results.jsonl)")
  return "\n".join(lines)


def _note(r: dict) -> str:
  for key in ("error", "skipped"):
    if r.get(key):
      return f"{key}: {str(r[key])[:90]}"
  if "mismatches" in r:  # (the W4A16 register plan's bitwise check)
    return "bitwise" if r["mismatches"] == 0 else f"{r['mismatches']} mismatches, max diff " \
        f"{_f(r.get('max_abs_diff'), 2)}"
  for key in ("rel_err_vs_reference", "rel_err_vs_default"):
    if key in r:
      return f"{key.replace('rel_err_vs_', 'err vs ')} {_f(r[key], 2)}"
  return ""


def _timed(r: dict) -> bool:
  return r.get("impl") not in ("cuda_export", "sass", "env", "weights", "pool", "stage_end",
                               "summary")


def _by_kind(r: dict, kind: str) -> str:
  return _f((r.get("by_kind") or {}).get(kind))


def sections(rows: list[dict]) -> list[str]:
  by_stage: dict[str, list[dict]] = {}
  for r in rows:
    by_stage.setdefault(r.get("stage", "?"), []).append(r)
  out = []
  env = next((r for r in by_stage.get("ceilings", []) if r.get("impl") == "env"), {})
  first = rows[0] if rows else {}
  out.append(f"device {env.get('name') or first.get('device', '?')} | jax {first.get('jax', '?')}"
             f" | commit {first.get('commit', '?')} | dry_run {first.get('dry_run')} | clocks "
             f"sm {env.get('clocks.sm', '?')} / max {env.get('clocks.max.sm', '?')}")
  ends = [r for r in rows if r.get("impl") == "stage_end"]
  if ends:
    out.append("stages: " + ", ".join(
        f"{r['stage']} rc={r.get('rc')} {r.get('seconds')}s/{r.get('limit_s')}s "
        f"rows={r.get('rows')}" for r in ends))
  c = [r for r in by_stage.get("ceilings", []) + by_stage.get("peers", [])
       if r.get("impl") in ("xla_copy", "xla_read", "xla_matmul_bf16", "torch_copy",
                            "torch_read")]
  if c:
    out.append("## ceilings\n" + table(c, [("impl", lambda r: r["impl"]),
                                         ("GB/s", lambda r: _f(r.get("gbps"), 4)),
                                         ("TFLOP/s", lambda r: _f(r.get("tflops"), 4)),
                                         ("us", lambda r: _f(r.get("us"))),
                                         ("by", lambda r: r.get("timed_by", "do_bench"))]))
  checks = [r for r in by_stage.get("kernel_check", []) if _timed(r) and "ok" in r]
  if checks:
    bad = [r for r in checks if not r["ok"]]
    out.append(f"kernel_check: {len(checks) - len(bad)} of {len(checks)} within tolerance" +
               "".join(f"\n- {r.get('case')} {json.dumps({k: r.get(k) for k in ('tokens', 'heads', 'lens', 'q_len') if k in r})}: "
                       f"{r.get('error') or _f(r.get('rel_err'))}"[:200] for r in bad))
  expert_cols = [("impl", lambda r: r["impl"]), ("case", lambda r: r.get("case")),
                 ("hit", lambda r: _f(r.get("experts_hit"))),
                 ("kernel us", lambda r: _f(r.get("us"))),
                 ("call us", lambda r: _f(r.get("call_us"))),
                 ("GB/s", lambda r: _f(r.get("gbps"))),
                 ("% ceil", lambda r: _pct(r.get("frac_ceiling"))), ("note", _note)]
  int4_cols = expert_cols[:4] + [("gate/up us", lambda r: _f(r.get("gate_up_us"))),
                                 ("down us", lambda r: _f(r.get("down_us")))] + expert_cols[4:]
  for stage in ("int4", "experts"):
    rs = [r for r in by_stage.get(stage, []) if _timed(r)]
    if rs:
      end = next((r for r in by_stage[stage] if r.get("impl") == "summary"), None)
      out.append(f"## {stage}\n" + table(rs, int4_cols if stage == "int4" else expert_cols) +
                 (f"\nplan bitwise {end.get('plan_bitwise')}, timed as {end.get('timed')}"
                  if end else ""))
    sass = [r for r in by_stage.get(stage, []) if r.get("impl") == "sass"]
    if sass:
      fam = lambda r, k: _f((r.get("families") or {}).get(k))
      out.append("SASS per module\n" + table(sass[:10], [
          ("module", lambda r: r.get("case", "")[:40]), ("instr", lambda r: r.get("instructions")),
          ("mma", lambda r: fam(r, "mma")), ("sts", lambda r: fam(r, "smem_store")),
          ("lds", lambda r: fam(r, "smem_load")), ("bit", lambda r: fam(r, "bit_ops")),
          ("bf16x2", lambda r: fam(r, "bf16x2_math")), ("regs", lambda r: _f(r.get("registers"))),
          ("spill B", lambda r: _f(r.get("spill_store_bytes")))]))
  rs = [r for r in by_stage.get("k25_slice", []) if _timed(r)]
  if rs:
    decode = {r.get("batch"): r["us"] for r in rs if r.get("kind") == "decode" and r.get("us")}
    out.append("## k25_slice\n" + table(rs, [
        ("case", lambda r: r.get("case")), ("us", lambda r: _f(r.get("us"))),
        ("kern us", lambda r: _f(r.get("kernel_us"))), ("gap us", lambda r: _f(r.get("gap_us"))),
        ("attn", lambda r: _by_kind(r, "attention")), ("moe", lambda r: _by_kind(r, "moe")),
        ("gemm", lambda r: _by_kind(r, "gemm")), ("xla", lambda r: _by_kind(r, "xla_other")),
        ("GB/s", lambda r: _f(r.get("gbps"))), ("% ceil", lambda r: _pct(r.get("frac_ceiling"))),
        ("% mm", lambda r: _pct(r.get("frac_matmul")) if r.get("kind") == "prefill" else "-"),
        ("/decode", lambda r: _f(r["us"] / decode[r["batch"]]) if r.get("us") and
         r.get("kind") == "verify" and decode.get(r.get("batch")) else "-"),
        ("compile s", lambda r: _f(r.get("compile_s"))), ("note", _note)]))
  out.extend(_layers(by_stage.get("layers", [])))
  out.extend(_eagle3(by_stage.get("eagle3", [])))
  rs = [r for r in by_stage.get("mla", []) if _timed(r)]
  checks = [r for r in rs if "ok" in r]
  if checks:
    bad = [r for r in checks if not r["ok"]]
    out.append(f"mla checks: {len(checks) - len(bad)} of {len(checks)} within tolerance" +
               "".join(f"\n- {r.get('case')}: err {_f(r.get('rel_err_vs_reference'))}"[:200]
                       for r in bad))
  if rs:
    # (the decode path's `us`: its two Mosaic kernels; `call us`: the standalone call)
    out.append("## mla\n" + table(rs, [
        ("group", lambda r: r.get("group", "")), ("case", lambda r: r.get("case")),
        ("us", lambda r: _f(r.get("us"))), ("call us", lambda r: _f(r.get("call_us"))),
        ("GB/s", lambda r: _f(r.get("gbps"))), ("% ceil", lambda r: _pct(r.get("frac_ceiling"))),
        ("note", _note)], max_rows=56))
  rs = [r for r in by_stage.get("peers", [])
        if _timed(r) and r.get("impl") not in ("torch_copy", "torch_read")]
  if rs:
    out.append("## peers (torch)\n" + table(rs, [
        ("impl", lambda r: r["impl"]), ("case", lambda r: r.get("case")),
        ("us", lambda r: _f(r.get("us"))), ("GB/s", lambda r: _f(r.get("gbps"))),
        ("% ceil", lambda r: _pct(r.get("frac_ceiling"))), ("note", _note)]))
  exports = [r for r in rows if r.get("impl") == "cuda_export"]
  if exports:
    bad = [r for r in exports if r.get("error") or not r.get("mosaic_calls")]
    out.append(f"CUDA lowering of the GPU programs (dry run): {len(exports) - len(bad)} of "
               f"{len(exports)} lower with Mosaic GPU calls" + "".join(
                   f"\n- FAILED {r['stage']} {r.get('case')}: {r.get('error', 'no Mosaic call')[:150]}"
                   for r in bad))
  return out


def _mib(v: Any) -> str:
  return "-" if v is None else f"{v / 2**20:.3g}"


def _layers(rows: list[dict]) -> list[str]:
  """Stage `layers` (issue 49): step time scanned / separate / unrolled with the scanned
  program's slice copies, then lower + compile seconds against depth."""
  out = []
  ratio = {r.get("case"): r for r in rows if r.get("impl") == "vs_separate"}
  steps = [r for r in rows if r.get("kind") == "decode" or
           (r.get("case", "").startswith("decode") and r.get("impl") in ("scan", "separate",
                                                                         "unrolled"))]
  if steps:
    out.append("## layers: decode step, scanned vs separate arrays vs unrolled\n" + table(
        steps, [
        ("impl", lambda r: r["impl"]), ("case", lambda r: r.get("case")),
        ("us/step", lambda r: _f(r.get("us"))), ("GB/s", lambda r: _f(r.get("gbps"))),
        ("% ceil", lambda r: _pct(r.get("frac_ceiling"))),
        ("/separate", lambda r: _f((ratio.get(r.get("case")) or {}).get(r["impl"]))),
        ("tokens = sep", lambda r: _f(((ratio.get(r.get("case")) or {}).get("tokens_agree")
                                       or {}).get(r["impl"]))),
        ("slice copy MiB/iter", lambda r: _mib(r.get("slice_copy_bytes"))),
        ("layer non-expert MiB", lambda r: _mib(r.get("layer_nonexpert_bytes"))),
        ("compile s", lambda r: _f(r.get("compile_s"))), ("note", _note)]))
  comp = [r for r in rows if r.get("case", "").startswith("compile ") and
          r.get("impl") != "cuda_export"]
  if comp:
    out.append("## layers: lower + compile s against depth (tiny widths)\n" + table(comp, [
        ("impl", lambda r: r["impl"]), ("case", lambda r: r.get("case")),
        ("lower s", lambda r: _f(r.get("lower_s"))),
        ("compile s", lambda r: _f(r.get("compile_s"))),
        ("HLO instr", lambda r: _f(r.get("hlo_instructions"))),
        ("kernels", lambda r: r.get("kernels", "-")), ("note", _note)]))
  return out


def _eagle3(rows: list[dict]) -> list[str]:
  """Stage `eagle3` (issue 55): each program's time, bytes and fraction with its time over the
  61-layer target step at its B, then the ratios per head, vocabulary and B."""
  out = []
  timed = [r for r in rows if _timed(r) and r.get("impl") != "ratio"]
  if timed:
    out.append("## eagle3: head programs, lm_head, K2.5 target step (target_61: slice x 61 "
               "layers + lm_head)\n" + table(timed, [
                   ("impl", lambda r: r["impl"]), ("case", lambda r: r.get("case")),
                   ("us", lambda r: _f(r.get("us"))), ("kern us", lambda r: _f(r.get("kernel_us"))),
                   ("gap us", lambda r: _f(r.get("gap_us"))),
                   ("MB", lambda r: _f(r["bytes"] / 1e6) if r.get("bytes") else "-"),
                   ("GB/s", lambda r: _f(r.get("gbps"))),
                   ("% ceil", lambda r: _pct(r.get("frac_ceiling"))),
                   ("/target", lambda r: _f(r.get("vs_target"))),
                   ("compile s", lambda r: _f(r.get("compile_s"))), ("note", _note)],
                   max_rows=40))
  ratios = [r for r in rows if r.get("impl") == "ratio"]
  if ratios:
    k = ratios[0].get("k")
    out.append(f"## eagle3: draft cost in target decode steps (K = {k})\n" + table(ratios, [
        ("head vocab B", lambda r: r.get("case")), ("chained us", lambda r: _f(r.get("chained_us"))),
        ("target us", lambda r: _f(r.get("target_us"))),
        ("step/target", lambda r: _f(r.get("draft_step_vs_target"))),
        ("K x", lambda r: _f(r.get("k_drafts_vs_target"))),
        ("(first+(K-1) chained)/target", lambda r: _f(r.get("drafting_vs_target")))]))
  return out


def summary(out_dir: str) -> str:
  rows = read_rows(out_dir)
  if not rows:
    return f"no rows in {os.path.join(out_dir, 'results.jsonl')}\n"
  parts = sections(rows)
  text = "\n\n".join(parts)
  while len(text) > LIMIT and len(parts) > 1:  # the most important sections come first
    parts = parts[:-1]
    text = "\n\n".join(parts) + "\n\n(summary cut at 9,500 characters: results.jsonl has all)"
  return text[:LIMIT] + "\n"


def main(out_dir: str) -> None:
  sys.stdout.write(summary(out_dir))


if __name__ == "__main__":
  main(sys.argv[1])
