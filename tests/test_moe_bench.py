"""The MoE benchmark's CPU path runs and writes its JSON (seconds; no GPU here)."""

import json

import jax
import pytest

from bench import moe_kernels


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU path")
def test_cpu_path_runs_references_and_says_so(tmp_path, capsys):
  out = tmp_path / "moe.json"
  moe_kernels.main(["--out", str(out), "--tokens", "1", "8", "--experts", "4",
                    "--iters", "1", "--reps", "1"])
  result = json.loads(out.read_text())
  assert result["platform"] == "cpu" and "reference implementations only" in result["note"]
  rows = {(r["impl"], r["tokens"]): r for r in result["rows"]}
  assert set(rows) == {(i, t) for i in ("ragged_dot", "dense") for t in (1, 8)}
  assert all(r["seconds"] > 0 for r in rows.values())
  assert "reference implementations only" in capsys.readouterr().out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU path")
def test_a_run_stopped_after_one_row_keeps_that_row(tmp_path, monkeypatch):
  """gpu_check.sh stops a stage at its time limit: what was measured is on disk by then."""
  def stop(row):
    raise KeyboardInterrupt
  monkeypatch.setattr(moe_kernels, "print_row", stop)
  out = tmp_path / "moe.json"
  with pytest.raises(KeyboardInterrupt):
    moe_kernels.main(["--out", str(out), "--tokens", "1", "8", "--experts", "4",
                      "--iters", "1", "--reps", "1"])
  rows = json.loads(out.read_text())["rows"]
  assert len(rows) == 1 and rows[0]["seconds"] > 0
