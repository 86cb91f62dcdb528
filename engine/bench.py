"""`python -m engine.bench`: serving benchmark over gRPC (see engine/service/bench.py)."""

from absl import app

from engine.service.bench import main

if __name__ == "__main__":
  app.run(main)
