"""SASS opcode counts, registers and spills of the Mosaic GPU kernels a stage compiled.

With `MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1`, Mosaic GPU prints each compiled
kernel's `nvdisasm` listing and the assembler's report to stdout (gpu_check.sh sends the int4
stage's stdout to a file; `MOSAIC_GPU_DUMP_TO` would add every MLIR pass, too slow for a
timed stage). `summarize(text)` turns each kernel listing into one row: its static instruction
count, the opcode families that decide a dequantizing matmul's cost per weight
(`../shared/gpu-plan.md` section 3: HGMMA, shared-memory stores and loads, LOP3 / PRMT / SEL
bit work, bf16x2 arithmetic, shuffles, barriers), the most frequent opcodes, its registers
(the listing's SHI_REGISTERS) and ptxas's stack frame and spill bytes for it.
"""

from __future__ import annotations

import collections
import re

# An instruction line of nvdisasm: `/*0a30*/   @!P0 HGMMA.64x8x16.F32.BF16 gdesc[UR4], ...`
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]*)?[\s;]")
# A kernel's code section: `//----- .text.body_mosaic_gpu_kernel -----`, else its label line.
_HEADER = re.compile(r"^\s*//-+\s*\.text\.([\w$.]+)\s+-+\s*$", re.M)
_LABEL = re.compile(r"^\s*\.text\.([\w$.]+):\s*$", re.M)
FAMILIES = {
    "mma": ("HGMMA", "HMMA", "QGMMA", "IMMA"),
    "smem_load": ("LDS", "LDSM"),
    "smem_store": ("STS",),
    "bit_ops": ("LOP3", "PRMT", "SEL", "SHF", "BMSK", "I2IP", "F2IP"),
    "bf16x2_math": ("HMUL2", "HFMA2", "HADD2", "HMNMX2"),
    "f32_math": ("FMUL", "FFMA", "FADD", "MUFU"),
    "shuffle": ("SHFL",),
    "barrier": ("BAR", "SYNCS", "WARPSYNC", "MEMBAR"),
    "tma": ("UTMALDG", "UTMASTG", "UBLKCP", "UTMAPF"),
    "global": ("LDG", "STG", "ATOM", "RED"),
}


def opcode_counts(text: str) -> collections.Counter:
  return collections.Counter(m.group(1) for m in _INSTR.finditer(text))


def _ptxas(text: str) -> dict[str, dict[str, int]]:
  """{entry name: {registers, stack_frame_bytes, spill_store_bytes, spill_load_bytes}} from
  ptxas -v reports (`Compiling entry function 'NAME'`, then its `Used N registers` lines)."""
  out: dict[str, dict[str, int]] = {}
  name = None
  for line in text.splitlines():
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
      name = m.group(1)
      continue
    if name is None:
      continue
    for key, pattern in (("registers", r"Used (\d+) registers"),
                         ("stack_frame_bytes", r"(\d+) bytes stack frame"),
                         ("spill_store_bytes", r"(\d+) bytes spill stores"),
                         ("spill_load_bytes", r"(\d+) bytes spill loads")):
      m = re.search(pattern, line)
      if m:
        out.setdefault(name, {})[key] = int(m.group(1))
  return out


def summarize(text: str) -> list[dict]:
  """One dict per kernel listing in `text` (in order; a kernel compiled twice appears twice,
  numbered): module, instructions, families, top opcodes, registers, ptxas's spills."""
  reports = _ptxas(text)
  sections = [(m.start(), m.group(1)) for m in _HEADER.finditer(text)] or [
      (m.start(), m.group(1)) for m in _LABEL.finditer(text)]
  rows, seen = [], collections.Counter()
  for i, (pos, name) in enumerate(sections):
    end = sections[i + 1][0] if i + 1 < len(sections) else len(text)
    body = text[pos:end]
    counts = opcode_counts(body)
    if not counts:
      continue
    seen[name] += 1
    row = dict(module=f"{name}#{seen[name]}", instructions=sum(counts.values()),
               families={f: sum(counts[o] for o in ops) for f, ops in FAMILIES.items()},
               top_opcodes=counts.most_common(14))
    m = re.search(r"SHI_REGISTERS=(\d+)", body)
    if m:
      row["registers"] = int(m.group(1))
    row.update({k: v for k, v in reports.get(name, {}).items() if k not in row})
    rows.append(row)
  return rows
