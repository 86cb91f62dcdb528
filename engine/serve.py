"""`python -m engine.serve`: the gRPC server (see engine/service/serve_cli.py)."""

from absl import app

from engine.service.serve_cli import main

if __name__ == "__main__":
  app.run(main)
