"""`python -m engine.client`: stream from a running server (see engine/service/client_cli.py)."""

from absl import app

from engine.service.client_cli import main

if __name__ == "__main__":
  app.run(main)
