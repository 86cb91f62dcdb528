"""How many KV cache pages an engine allocates, the same number in every process of a job.

The cache is one global array over the mesh, and every process of a multi-process job must run
the same programs on it: a process that chose another page count would compile other programs
and the job would hang in their collectives. So each process measures only the devices it can
address (`memory_stats` of another process's device raises), chooses a count from its own
free memory, and the job takes the smallest choice (`sharding.gather_from_processes`); a count
given explicitly must be the same everywhere, and a difference is an error naming each
process's value.
"""

from __future__ import annotations

from typing import Any, Iterable

from engine.model import sharding


def free_device_bytes(devices: Iterable[Any]) -> int | None:
  """The least free memory (`bytes_limit - bytes_in_use`) over those of `devices` this process
  addresses and that report statistics; None when none does (XLA:CPU reports none)."""
  free = []
  for d in devices:
    if d.process_index != sharding.process_index():
      continue
    stats = d.memory_stats() or {}
    if "bytes_limit" in stats:
      free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return min(free) if free else None


def pages_for(free_bytes: int | None, page_bytes: int, fraction: float, fallback: int) -> int:
  """`fraction` of the free bytes in pages (at least 2: the null page and one); without memory
  statistics, `fallback` (the engine's: room for every sequence at full length)."""
  if free_bytes is None:
    return fallback
  return max(2, int(free_bytes * fraction) // page_bytes)


def agree_num_pages(local: int, explicit: bool) -> int:
  """The job's page count from this process's `local` one: the smallest over the processes,
  or, when the count was given (`explicit`), the common value (ValueError if they differ)."""
  values = sharding.gather_from_processes(local)
  if explicit and len(set(values)) > 1:
    raise ValueError("num_pages: processes were given different values "
                     f"({', '.join(f'process {i}: {v}' for i, v in enumerate(values))}); "
                     "start every process with the same flags")
  return min(values)
