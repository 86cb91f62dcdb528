"""Generated gRPC stubs (proto/generate.py)."""
