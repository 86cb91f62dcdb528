"""`python -m engine.generate`: generate from a checkpoint (see engine/service/generate_cli.py)."""

from absl import app

from engine.service.generate_cli import main

if __name__ == "__main__":
  app.run(main)
