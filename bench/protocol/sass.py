"""SASS opcode counts, registers and spills of the Mosaic GPU kernels a stage compiled.

With `MOSAIC_GPU_DUMP_TO=DIR`, Mosaic GPU writes per compiled module `<name>_<n>.sass` (the
`nvdisasm` listing) and `<name>_<n>.ptxas` (the assembler's report), besides PTX and MLIR.
`summarize(DIR)` turns each module into one row: its static instruction count, the opcode
families that decide a dequantizing matmul's cost per weight (the plan in
`../shared/gpu-plan.md` section 3: HGMMA, shared-memory loads and stores, LOP3 / PRMT / SEL
bit work, bf16x2 arithmetic, shuffles, barriers), the most frequent opcodes, and the
registers, stack frame and spill bytes ptxas reports.
"""

from __future__ import annotations

import collections
import glob
import os
import re

# An instruction line of nvdisasm: `/*0a30*/   @!P0 HGMMA.64x8x16.F32.BF16 gdesc[UR4], ...`
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]*)?[\s;]")
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


def ptxas_report(text: str) -> dict[str, int]:
  """Registers, stack frame and spill bytes from ptxas -v output (the largest over entries)."""
  out = {}
  for key, pattern in (("registers", r"Used (\d+) registers"),
                       ("stack_frame_bytes", r"(\d+) bytes stack frame"),
                       ("spill_store_bytes", r"(\d+) bytes spill stores"),
                       ("spill_load_bytes", r"(\d+) bytes spill loads")):
    values = [int(v) for v in re.findall(pattern, text)]
    if values:
      out[key] = max(values)
  return out


def summarize(dump_dir: str) -> list[dict]:
  """One dict per dumped module: module, instructions, families, top opcodes, ptxas report."""
  rows = []
  for path in sorted(glob.glob(os.path.join(dump_dir, "*.sass"))):
    module = os.path.basename(path)[:-len(".sass")]
    with open(path, errors="replace") as fh:
      counts = opcode_counts(fh.read())
    if not counts:
      continue
    row = dict(module=module, instructions=sum(counts.values()),
               families={f: sum(counts[o] for o in ops) for f, ops in FAMILIES.items()},
               top_opcodes=counts.most_common(14))
    ptxas = os.path.join(dump_dir, module + ".ptxas")
    if os.path.exists(ptxas):
      with open(ptxas, errors="replace") as fh:
        row.update(ptxas_report(fh.read()))
    rows.append(row)
  return rows
