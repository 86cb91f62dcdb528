"""A learned n-gram drafter: an on-device hash table, context n-gram -> next-token candidates,
taught every token any request emits and kept across calls (and processes: `NgramMemory`), so
traffic that repeats earlier outputs (tool calls, boilerplate, code edits) drafts well from a
new request's first token (prompt lookup only searches the row's own context). A context
hashes to one slot, which keeps the hash as a tag (another context evicts it) and C candidates
with decayed counts; drafting takes the best candidate of the longest order that knows the
context (ORDERS) and chains on its own drafts. Deterministic: verified with one-hot q.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig
from engine.runtime.engine_config import EngineConfig
from engine.runtime.speculative.drafters.base import Drafter, LoopContext, Proposal

# Context lengths, longest first; two keep a lookup at two gathers per draft. (4, 2) drafts
# 12-19% more tokens per forward than (3, 2) on a second pass over what the table learned, but
# 2% fewer on a first (bench.speculative's agent rows at batch 1: 2.49 / 2.95 vs 2.54 / 3.02 at
# K = 4 / 8); (4, 3, 2) is no better than (4, 2) (`bench.spec_constants`; BENCHMARKS.md, "the
# speculative constants"). Kept until traffic with repeats across requests decides.
ORDERS = (3, 2)
_MULT = np.uint32(0x9E3779B1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramTable:
  tags: jax.Array  # [S] uint32 hash of the context owning the slot
  used: jax.Array  # [S] bool
  tokens: jax.Array  # [S, C] int32 candidate next tokens (-1: empty)
  counts: jax.Array  # [S, C] float32 decayed counts

  @staticmethod
  def empty(num_slots: int = EngineConfig.learned_table_slots, num_candidates: int = 4
            ) -> "NgramTable":
    """An empty table (the default sizes are chosen, not measured)."""
    return NgramTable(tags=jnp.zeros((num_slots,), jnp.uint32),
                      used=jnp.zeros((num_slots,), bool),
                      tokens=jnp.full((num_slots, num_candidates), -1, jnp.int32),
                      counts=jnp.zeros((num_slots, num_candidates), jnp.float32))


def context_hash(ctx: jax.Array) -> jax.Array:
  """ctx [..., n] int32 -> [...] uint32 (the order is part of the hash)."""
  h = jnp.full(ctx.shape[:-1], np.uint32(ctx.shape[-1] * 0x85EBCA6B & 0xFFFFFFFF), jnp.uint32)
  for i in range(ctx.shape[-1]):
    h = (h ^ ctx[..., i].astype(jnp.uint32)) * _MULT
    h = h ^ (h >> 15)
  return h


def _contexts(history: jax.Array, ends: jax.Array, order: int) -> jax.Array:
  """history [B, L]; ends [B, T] index of each context's last token -> [B, T, order]."""
  offs = jnp.arange(order - 1, -1, -1, dtype=jnp.int32)
  idx = jnp.clip(ends[..., None] - offs, 0, history.shape[1] - 1)
  return jnp.take_along_axis(history[:, None, :], idx, axis=2)


def update(table: NgramTable, history: jax.Array, positions: jax.Array, valid: jax.Array,
           decay: float = 0.95) -> NgramTable:
  """Learns that history[b, p] ([B, L]) followed its context, for every valid [B, T] position
  p of positions [B, T]. One observation per slot and call: when several land in one slot, the
  last in row-major order wins (a sequential loop over them cost more per decode iteration
  than the drafts saved). A slot's counts decay by `decay` per update: 0.95 and 0.99 draft
  alike, 0.5 and 0.8 3-10% fewer tokens per forward on a second pass, 1.0 (never forgetting a
  stale candidate) 3-7% more on a second pass over the very same text (`bench.spec_constants`;
  BENCHMARKS.md, "the learned table's decay")."""
  hashes, toks, oks = [], [], []
  tok = jnp.take_along_axis(history, jnp.clip(positions, 0, history.shape[1] - 1), axis=1)
  for order in ORDERS:
    hashes.append(context_hash(_contexts(history, positions - 1, order)).reshape(-1))
    toks.append(tok.reshape(-1))
    oks.append((valid & (positions >= order)).reshape(-1))
  hashes, toks, oks = jnp.concatenate(hashes), jnp.concatenate(toks), jnp.concatenate(oks)
  num_slots, num_cand = table.tokens.shape
  slots = (hashes % np.uint32(num_slots)).astype(jnp.int32)
  index = jnp.arange(hashes.shape[0], dtype=jnp.int32)
  last = jnp.full((num_slots,), -1, jnp.int32).at[jnp.where(oks, slots, num_slots)].max(
      index, mode="drop")
  target = jnp.where(oks & (last[slots] == index), slots, num_slots)  # out of range: dropped
  mine = table.used[slots] & (table.tags[slots] == hashes)
  row_tok = jnp.where(mine[:, None], table.tokens[slots], -1)  # [N, C]
  row_cnt = jnp.where(mine[:, None], table.counts[slots] * decay, 0.0)
  hit = row_tok == toks[:, None]
  known = jnp.any(hit, axis=1)
  col = jnp.where(known, jnp.argmax(hit, axis=1), jnp.argmin(row_cnt, axis=1))
  at_col = jnp.arange(num_cand)[None, :] == col[:, None]
  row_cnt = jnp.where(at_col, jnp.where(known[:, None], row_cnt, 0.0) + 1.0, row_cnt)
  row_tok = jnp.where(at_col, toks[:, None], row_tok)
  # The scatters into tags and used do not depend on the reads above, so XLA could order
  # them first and keeps the old arrays alive with a copy of each (every decode iteration);
  # the barrier makes the updated rows an input of every write.
  (row_tok, row_cnt), table = jax.lax.optimization_barrier(((row_tok, row_cnt), table))
  return NgramTable(tags=table.tags.at[target].set(hashes, mode="drop"),
                    used=table.used.at[target].set(True, mode="drop"),
                    tokens=table.tokens.at[target].set(row_tok, mode="drop"),
                    counts=table.counts.at[target].set(row_cnt, mode="drop"))


def lookup(table: NgramTable, ctx: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Best next token after each context ctx [B, max(ORDERS)] (most recent last): (token [B]
  int32, found [B] bool), the longest order that knows the context winning."""
  num_slots = table.tags.shape[0]
  tok = jnp.zeros(ctx.shape[:1], jnp.int32)
  found = jnp.zeros(ctx.shape[:1], bool)
  for order in ORDERS:
    h = context_hash(ctx[:, -order:])
    slot = (h % np.uint32(num_slots)).astype(jnp.int32)
    best = jnp.argmax(table.counts[slot], axis=1)[:, None]
    tok = jnp.where(found, tok, jnp.take_along_axis(table.tokens[slot], best, axis=1)[:, 0])
    found = found | (table.used[slot] & (table.tags[slot] == h))
  return tok, found


def propose(table: NgramTable, history: jax.Array, newest: jax.Array, k: int
            ) -> tuple[jax.Array, jax.Array]:
  """Up to K chained drafts per row after history[b, :newest[b] + 1]: (draft [B, K] int32,
  n_draft [B] int32, the drafts before the first unknown context)."""
  n = max(ORDERS)
  ctx = _contexts(history, newest[:, None], n)[:, 0]  # [B, n]
  # Rows with fewer than n tokens: their missing context entries are position 0's token, so a
  # short row only matches contexts that really began that way; acceptable for a drafter.
  drafts, alive = [], jnp.ones(newest.shape, bool)
  n_draft = jnp.zeros(newest.shape, jnp.int32)
  for _ in range(k):
    tok, found = lookup(table, ctx)
    alive = alive & found
    n_draft = n_draft + alive.astype(jnp.int32)
    drafts.append(tok)
    ctx = jnp.concatenate([ctx[:, 1:], tok[:, None]], axis=1)
  return jnp.stack(drafts, axis=1), n_draft


def propose_or_one(table: NgramTable, history: jax.Array, newest: jax.Array, k: int,
                   drafting: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`propose` of K drafts when `drafting` (a traced bool), else of one padded to K: an
  iteration that verifies nothing only compares one looked-up token with the emitted one."""
  def one(_):
    d, n = propose(table, history, newest, 1)
    return jnp.pad(d, ((0, 0), (0, k - 1))), n

  return jax.lax.cond(drafting, lambda _: propose(table, history, newest, k), one, None)


def last_tokens(reqs: Sequence[Any], b: int, width: int, columns: int | None = None, *,
                right_align: bool = False) -> np.ndarray:
  """[b, columns or width] each request's last `width` tokens, oldest first (from column 0,
  or ending at column width - 1 with `right_align`), zeros elsewhere."""
  out = np.zeros((b, columns or width), np.int32)
  for i, req in enumerate(reqs):
    last = req.all_ids[-width:]
    start = width - len(last) if right_align else 0
    out[i, start:start + len(last)] = last
  return out


@dataclasses.dataclass(frozen=True)
class LearnedDrafter(Drafter):
  """The table as a drafter: looked up before the loop's plain / block conditional and taught
  after it (a table updated inside a branch would be copied every iteration, `inplace`), and
  taught by plain calls too."""
  name = "learned"
  deterministic = True
  learns_from_plain = True
  junk_changes_state = True
  cfg: ModelConfig
  slots: int = EngineConfig.learned_table_slots

  @classmethod
  def create(cls, cfg, config, draft_cfg, head_cfg=None) -> "LearnedDrafter":
    return cls(cfg=cfg, slots=config.learned_table_slots)

  def init_state(self, num_pages, page_size, dtype, place_cache, place_state) -> NgramTable:
    return place_state(NgramTable.empty(self.slots))

  def start(self, state: NgramTable, rows: Any, b: int, k_max: int) -> dict:
    return {"table": state}

  def prepare(self, ctx: LoopContext, st: dict, drafting: jax.Array) -> tuple[Any, dict]:
    # Drafts are looked up before the conditional: k_max, or one for a plain iteration (the
    # barrier keeps XLA from sinking the reads into the branches).
    proposal = propose_or_one(st["table"], ctx.history, ctx.history_len - 1, ctx.k_max,
                              drafting)
    proposal, table = jax.lax.optimization_barrier((proposal, st["table"]))
    return table, {"proposal": proposal}

  def propose(self, ctx: LoopContext, st: dict, cache: Any, k: int
              ) -> tuple[Proposal, dict, Any]:
    d, n = st["proposal"]
    return Proposal(d[:, :k], jnp.minimum(n, k), None, jnp.bool_(True)), st, cache

  def learn(self, ctx: LoopContext, st: dict, held: NgramTable, before: jax.Array) -> dict:
    slots = jnp.arange(ctx.k_max + 1, dtype=jnp.int32)[None, :]
    return {"table": update(held, ctx.history, before[:, None] + slots,
                            slots < (ctx.history_len - before)[:, None])}

  def finish(self, ctx: LoopContext, st: dict) -> tuple[NgramTable, None]:
    return st["table"], None

  def learn_plain(self, state: NgramTable, inputs: dict[str, jax.Array], out: jax.Array,
                  count: jax.Array) -> NgramTable:
    """Every new token of the rows `learn_rows` [B] after their `context` [B, C] (each row's
    last tokens before the call)."""
    context, learn_rows = inputs["context"], inputs["learn_rows"]
    cols = jnp.arange(out.shape[1], dtype=jnp.int32)
    positions = jnp.broadcast_to(context.shape[1] + cols, out.shape)
    valid = (cols[None, :] < count[:, None]) & learn_rows[:, None]
    return update(state, jnp.concatenate([context, out], axis=1), positions, valid)

  def plain_inputs(self, reqs: Sequence[Any], b: int) -> dict[str, np.ndarray]:
    """Each row's last tokens before the call, and which rows teach (not padding)."""
    return {"context": last_tokens(reqs, b, max(ORDERS), right_align=True),
            "learn_rows": np.arange(b) < len(reqs)}


class NgramMemory:
  """Host handle on a learned table that persists across `engine.generate` calls and processes
  (it is replaced by the updated table after each call; the old device buffers are donated)."""
  drafter = LearnedDrafter.name

  def __init__(self, table: NgramTable | None = None,
               num_slots: int = EngineConfig.learned_table_slots):
    self.table = table if table is not None else NgramTable.empty(num_slots)

  @property
  def num_slots(self) -> int:
    return int(self.table.tags.shape[0])

  @staticmethod
  def load_or_new(path: str | None) -> "NgramMemory":
    """The table saved at `path` if it exists, else an empty one."""
    import os
    return NgramMemory.load(path) if path and os.path.exists(path) else NgramMemory()

  def save(self, path: str) -> None:
    """Writes the table as a .npz file."""
    np.savez(path, **{f.name: np.asarray(getattr(self.table, f.name))
                      for f in dataclasses.fields(NgramTable)})

  @staticmethod
  def load(path: str) -> "NgramMemory":
    with np.load(path) as z:
      return NgramMemory(NgramTable(**{f.name: jnp.asarray(z[f.name])
                                       for f in dataclasses.fields(NgramTable)}))
