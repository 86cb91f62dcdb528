"""The drafter interface: what every drafter module implements for the speculative loop.

A drafter is a frozen (hashable) dataclass: its static configuration is part of the jitted
loop's static configuration. Its mutable state lives elsewhere and is passed in: the engine-wide
device state (`init_state`: the learned table, the draft model's cache) in the model runner,
each request's row state (`row_width` float32 values per row: the MTP layer's hidden state) in
the request on the host, travelling in every step description.

In the loop (`loop.speculative_decode_loop`), one iteration calls, for every enabled drafter:

  prepare   before the plain / block conditional (state kept out of it: `held`)
  propose   inside the branch of block width k: up to k tokens per row (and q, for sampled rows)
  observe   after verification: what the rows emitted, the target's hidden states
  learn     after the conditional (gets `held` back)

`start` / `finish` turn the persistent and row state into the loop's carried state and back.
Host-side hooks (`before_call`, `after_call`) let a drafter run programs of its own before a
call (the draft model's catch-up), through step descriptions the runner executes (`program`).
Adding a drafter: one module implementing this class, one line in `drafters/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice
from engine.runtime.speculative.inplace import run_if

AUTO = "auto"  # a request's drafter chosen by the loop from measured acceptance and costs
OFF = "off"


@dataclasses.dataclass(frozen=True)
class Proposal:
  """A drafter's proposal for one iteration: tokens [B, k] (the first `count` [B] real), its
  distribution q [B, k, V] (None: deterministic, verified against the target's own samples)
  and whether it was computed (bool, scalar or [B]: only computed proposals are evidence)."""
  tokens: jax.Array
  count: jax.Array
  q: jax.Array | None
  computed: jax.Array


@dataclasses.dataclass(frozen=True)
class LoopContext:
  """What a drafter may read in one iteration of the loop (traced values)."""
  params: Any  # the target's parameters
  own_params: Any  # the drafter's own weights (the draft model's), or None
  cfg: ModelConfig
  impl: KernelChoice
  page_table: jax.Array  # [B, P]
  sampling: Any  # SamplingArrays [B]
  tok: jax.Array  # [B] newest token (position n_cached), not yet in the cache
  n_cached: jax.Array  # [B]
  live: jax.Array  # [B] bool
  history: jax.Array  # [B, W] recent tokens, oldest first; history_len [B] of them
  history_len: jax.Array
  uses: jax.Array  # [B] bool: rows drafting with this drafter this iteration
  fed: jax.Array  # [B] bool: rows this drafter is kept current for in this call
  k_max: int


class Drafter:
  """Base of every drafter (see the module docstring). Subclasses are frozen dataclasses."""
  name: ClassVar[str]
  aliases: ClassVar[tuple[str, ...]] = ()  # other names requests may give it (gRPC's)
  # Verified against the target's own (seed, position) samples: its drafts carry no q.
  deterministic: ClassVar[bool] = False
  # Prefill chunks build its rows' state (the mixed step runs `observe_prefill`).
  observes_prefill: ClassVar[bool] = False
  # A row drafting with it speculates in every call (its cache must see every verified block).
  needs_every_block: ClassVar[bool] = False
  # Its state is current only in the rows it is fed (only those may draft with it).
  fed_per_row: ClassVar[bool] = False
  # The plain decode loop teaches it every emitted token (`learn_plain`).
  learns_from_plain: ClassVar[bool] = False
  # Uses a draft model (`Engine(draft=...)`, `SpeculativeConfig(draft_cfg=, draft_params=)`).
  uses_draft_model: ClassVar[bool] = False
  # Uses an EAGLE-3 head (`Engine(head=...)`, `SpeculativeConfig(checkpoint=)`).
  uses_head: ClassVar[bool] = False
  # Requests with images are refused by an engine that has it (why).
  refuses_images: ClassVar[str | None] = None
  # Constrained rows draft with its host form (`host_propose`).
  drafts_on_host: ClassVar[bool] = False
  # Constrained rows draft with it on the device: the masked step runs its `observe` and
  # `propose` (`speculative/constrained.py`), the host checks the drafts against the grammar.
  drafts_constrained: ClassVar[bool] = False
  # Junk rows (warm-up, timing) would change its state: the runner hands it a copy.
  junk_changes_state: ClassVar[bool] = False

  # The target layers whose input residual stream its `observe` / `observe_prefill` need for
  # every verified position (EAGLE-3's three aux layers; an instance field there): the loop's
  # verify and the mixed step then run `forward_hidden_states` and hand them over
  # (`Verified.aux`, `observe_prefill(aux=)`). () : the final hidden state only.
  aux_layers: tuple[int, ...] = ()

  cfg: ModelConfig  # the target's

  # ---- what it is, on the host -----------------------------------------------------------

  @classmethod
  def create(cls, cfg: ModelConfig, config: Any, draft_cfg: ModelConfig | None,
             head_cfg: Any = None) -> "Drafter":
    """This drafter for the target `cfg`, an `EngineConfig`, the draft model's config and the
    EAGLE-3 head's (`eagle3_config.Eagle3Config`)."""
    return cls(cfg=cfg)

  @classmethod
  def unsupported(cls, cfg: ModelConfig, draft_cfg: ModelConfig | None,
                  head_cfg: Any = None) -> str | None:
    """Why this model (and draft model, EAGLE-3 head) cannot use it, or None."""
    return None

  def roofline_cost(self) -> float:
    """What a drafted column costs, in plain decode iterations of the target, by the roofline
    (`costs.roofline`; 0 for lookups)."""
    return 0.0

  @staticmethod
  def host_propose(ids: Sequence[int], k: int, window: int) -> list[int] | None:
    """Its drafts computed on the host (constrained rows, `structured.py`); None: it has no
    host form."""
    return None

  def row_width(self) -> int:
    """float32 values of row state per request (0: none)."""
    return 0

  def cache_entries(self) -> tuple[dict[str, tuple[int, ...]], ...]:
    """Entries it adds to the target's paged cache after the model's own (`cache.init_cache`'s
    `extra`: each page array's shape per token): same page ids, so prefix caching, preemption
    and page freeing cover them."""
    return ()

  def cache_shardings(self, mesh: Any) -> tuple[dict[str, Any], ...]:
    """Where each of `cache_entries` lives on `mesh`: a `NamedSharding` per page array
    (default: replicated)."""
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return tuple({k: everywhere for k in e} for e in self.cache_entries())

  # ---- engine-wide device state (the model runner's) ---------------------------------------

  def init_state(self, num_pages: int, page_size: int, dtype: Any, place_cache: Any,
                 place_state: Any) -> Any:
    """Its persistent device state (None: none), placed like the engine's own."""
    return None

  def clear_null_page(self, state: Any) -> Any:
    """The state with page 0 cleared again (after timing calls wrote junk there)."""
    return state

  # ---- the loop -----------------------------------------------------------------------------

  def start(self, state: Any, rows: jax.Array | None, b: int, k_max: int) -> Any:
    """The loop's carried state from the persistent state and the rows' state [B, width]."""
    return {} if state is None and rows is None else {"state": state, "rows": rows}

  def prepare(self, ctx: LoopContext, st: Any, drafting: jax.Array) -> tuple[Any, Any]:
    """Before the conditional: (held out of it, state carried into it)."""
    return None, st

  def propose(self, ctx: LoopContext, st: Any, cache: Any, k: int
              ) -> tuple[Proposal, Any, Any]:
    """Up to k >= 1 drafts per row: (proposal, state, target cache)."""
    raise NotImplementedError

  def observe(self, ctx: LoopContext, st: Any, cache: Any, verified: Any, k: int
              ) -> tuple[Any, Any]:
    """After verification of a block of width k (`loop.Verified`): (state, target cache)."""
    return st, cache

  def learn(self, ctx: LoopContext, st: Any, held: Any, before: jax.Array) -> Any:
    """After the conditional; `before` [B]: history_len before the iteration."""
    return st

  def finish(self, ctx: LoopContext, st: Any) -> tuple[Any, jax.Array | None]:
    """After the loop: (persistent state, rows' state)."""
    return (st or {}).get("state"), (st or {}).get("rows")

  # ---- other programs -----------------------------------------------------------------------

  def observe_prefill(self, params: Any, cache: Any, hidden: jax.Array,
                      next_tokens: jax.Array, start: jax.Array, n_new: jax.Array,
                      page_table: jax.Array, *, impl: KernelChoice, own_params: Any = None,
                      aux: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """A mixed step's chunk (target hidden [B, W, H], the token after each position; its own
    weights; `aux` [B, W, len(aux_layers) * H] the residual streams entering `aux_layers`):
    (the rows' state at each row's last position [B, width], target cache)."""
    raise NotImplementedError

  def learn_plain(self, state: Any, inputs: dict[str, jax.Array], out: jax.Array,
                  count: jax.Array) -> Any:
    """The plain loop's new tokens out [B, N] (count [B] real) taught; `inputs`: its
    `plain_inputs`."""
    return state

  def plain_inputs(self, reqs: Sequence[Any], b: int) -> dict[str, np.ndarray]:
    """Host inputs of `learn_plain` for a plain call of `reqs` padded to b rows."""
    return {}

  def host_state(self, pool: Any) -> Any:
    """Its bookkeeping on the engine core's side (None: none)."""
    return None

  def before_call(self, host: Any, reqs: Sequence[Any], fed: np.ndarray, table: np.ndarray,
                  shape: Any, budget: int, max_spans: int, counters: dict
                  ) -> list[dict[str, np.ndarray]]:
    """Inputs of its own programs to run before a speculative call of `reqs` (`program`)."""
    return []

  def after_call(self, host: Any, reqs: Sequence[Any], fed: np.ndarray,
                 counts: np.ndarray) -> None:
    """After a speculative call: rows emitted counts[i] tokens."""

  def program(self, state: Any, own_params: Any, arrays: dict[str, Any], *,
              impl: KernelChoice) -> tuple[Any, tuple, dict]:
    """Its own program for `arrays` (`before_call`'s): (fn, args, kwargs) whose result is the
    new state."""
    raise NotImplementedError

  def warm_arrays(self, b: int, w: int, past: np.ndarray, table: np.ndarray
                  ) -> dict[str, np.ndarray] | None:
    """`program` inputs for b rows of w tokens written nowhere (warm-up), or None."""
    return None

  def counters(self) -> dict[str, int]:
    """Its own engine counters (zeroed)."""
    return {}


def propose_when_used(ctx: LoopContext, k: int, propose: Any, state: Any
                      ) -> tuple[Proposal, Any]:
  """A model drafter's proposal of k drafts in every row: propose(state) -> (draft [B, k],
  q [B, k, V], state), run only when a live row drafts with it (else zeros and `state` as it
  was; `inplace.run_if`, so a cache in `state` is updated in place)."""
  b = ctx.tok.shape[0]
  wanted = jnp.any(ctx.uses & ctx.live)
  nothing = (jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k, ctx.cfg.vocab_size), jnp.float32))
  draft, q, state = run_if(wanted, lambda s: propose(s[2]), (*nothing, state))
  return Proposal(draft, jnp.full((b,), k, jnp.int32), q, wanted), state


def aux_layers_of(drafters: Sequence[Drafter]) -> tuple[int, ...]:
  """Every layer some drafter reads the entering residual stream of (`Drafter.aux_layers`), in
  first-asked order: what the forward feeding them must return."""
  out: list[int] = []
  for d in drafters:
    out += [i for i in d.aux_layers if i not in out]
  return tuple(out)


def zeros_like_shape(shape: Any) -> Any:
  """Zeros of a `jax.eval_shape` result."""
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shape)
