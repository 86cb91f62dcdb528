"""deploy/: the LeaderWorkerSet manifest parses and serves Kimi K2.5 on 2 x 8 GPUs with its
probes on /health; the container, the manifest and the SLURM script pass only flags that
`engine.serve` defines, with values its parsers accept."""

import json
import math
import os
import re
import shlex
import tomllib

import pytest
import yaml
from absl import flags

from engine.model import sharding
from engine.runtime import compile_cache
from engine.service import launch_env
from engine.service import serve_cli  # noqa: F401 (defines engine.serve's flags)

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy")


def _read(name):
  with open(os.path.join(DEPLOY, name)) as fh:
    return fh.read()


def _check_serve_flags(args):
  """Every --name=value is one of engine.serve's flags and its value parses (--name and
  --noname for booleans); returns {name: parsed value}."""
  out = {}
  for arg in args:
    assert arg.startswith("--"), arg
    name, eq, value = arg[2:].partition("=")
    if eq:
      assert name in flags.FLAGS, f"engine.serve has no flag --{name}"
      out[name] = flags.FLAGS[name].parser.parse(value)
    else:
      base = name[2:] if name not in flags.FLAGS and name.startswith("no") else name
      assert base in flags.FLAGS, f"engine.serve has no flag --{name}"
      assert flags.FLAGS[base].boolean, f"--{name}: needs a value"
      out[base] = base == name
  return out


def _containers(manifest):
  tmpl = manifest["spec"]["leaderWorkerTemplate"]
  return (tmpl["leaderTemplate"]["spec"]["containers"][0],
          tmpl["workerTemplate"]["spec"]["containers"][0])


def test_leaderworkerset_manifest():
  docs = list(yaml.safe_load_all(_read("kimi-k25-lws.yaml")))
  assert len(docs) == 1
  lws = docs[0]
  assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
  tmpl = lws["spec"]["leaderWorkerTemplate"]
  assert tmpl["restartPolicy"] == "RecreateGroupOnPodRestart"
  leader, worker = _containers(lws)
  assert leader["args"] == worker["args"]  # every host runs the same command
  got = _check_serve_flags(leader["args"])
  gpus = [c["resources"]["limits"]["nvidia.com/gpu"] for c in (leader, worker)]
  # Kimi K2.5 on 2 x 8 GPUs: the mesh spans both pods' GPUs.
  assert tmpl["size"] == 2 and gpus == [8, 8]
  assert math.prod(sharding.parse_mesh(got["mesh"]).values()) == 16
  assert "Kimi-K2.5" in got["checkpoint"]
  ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
  assert ports["http"] == got["http_port"] and ports["grpc"] == got["port"]
  assert ports["coordinator"] == got["coordinator_port"]
  assert ports["lockstep"] == got["lockstep_port"]
  # Readiness of the leader and liveness of the follower on /health of the HTTP port.
  assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
  assert worker["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
  assert worker["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
  assert "livenessProbe" not in leader  # 503 while warming up or draining is not death
  spec = tmpl["leaderTemplate"]["spec"]
  assert spec["terminationGracePeriodSeconds"] > got["drain_timeout_s"]
  # The compilation cache on a volume.
  mounts = {m["name"]: m["mountPath"] for m in leader["volumeMounts"]}
  assert compile_cache_dir_in_image().startswith(mounts["jax-cache"] + "/")
  assert any(v["name"] == "jax-cache" and "persistentVolumeClaim" in v for v in spec["volumes"])
  # What LeaderWorkerSet's variables make of it.
  for index in (0, 1):
    job = launch_env.job_from(None, None, None, got["coordinator_port"], {
        "LWS_LEADER_ADDRESS": "kimi-k25-0.kimi-k25.default", "LWS_GROUP_SIZE": str(tmpl["size"]),
        "LWS_WORKER_INDEX": str(index)})
    assert job == launch_env.Job("kimi-k25-0.kimi-k25.default:8476", 2, index,
                                 "LeaderWorkerSet")


def _dockerfile_json(instruction):
  m = re.search(rf"^{instruction}\s+(\[.*\])\s*$", _read("Dockerfile"), re.M)
  assert m, f"no exec-form {instruction}"
  return json.loads(m.group(1))


def compile_cache_dir_in_image():
  m = re.search(rf"^ENV {compile_cache.ENV}=(\S+)$", _read("Dockerfile"), re.M)
  assert m, f"the Dockerfile sets no {compile_cache.ENV}"
  return m.group(1)


def test_dockerfile():
  text = _read("Dockerfile")
  assert re.search(r"^FROM nvidia/cuda:12\.\S+$", text, re.M)
  assert 'pip install ".[cuda12]"' in text
  with open(os.path.join(os.path.dirname(DEPLOY), "pyproject.toml"), "rb") as fh:
    assert "cuda12" in tomllib.load(fh)["project"]["optional-dependencies"]
  assert _dockerfile_json("ENTRYPOINT") == ["python", "-m", "engine.serve"]
  _check_serve_flags(_dockerfile_json("CMD"))
  volume = re.search(r"^VOLUME\s+(\S+)$", text, re.M).group(1)
  assert compile_cache_dir_in_image().startswith(volume + "/")
  # Every directory the package installs from is copied in.
  for pkg in ("engine", "pallas_kernels", "checkpoints"):
    assert re.search(rf"^COPY {pkg} {pkg}$", text, re.M), pkg


def test_slurm_script():
  text = _read("kimi-k25.sbatch")
  sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", text, re.M))
  assert (sbatch["nodes"], sbatch["ntasks-per-node"], sbatch["gpus-per-node"]) == ("2", "1", "8")
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("srun "))
  end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\\"))
  command = shlex.split(" ".join(l.rstrip("\\") for l in lines[start:end + 1]))
  assert command[command.index("python"):][:3] == ["python", "-m", "engine.serve"]
  got = _check_serve_flags(command[command.index("engine.serve") + 1:])
  assert math.prod(sharding.parse_mesh(got["mesh"]).values()) == 16


@pytest.mark.parametrize("bad", [["--no_such_flag=1"], ["--mesh"], ["--max_num_seqs=zero"]])
def test_flag_check_can_fail(bad):
  with pytest.raises((AssertionError, ValueError, flags.Error)):
    _check_serve_flags(bad)
