"""Serving SlimWise decoders in a real engine (llama.cpp): GGUF conversion, the full-prefill -> pruned-decode
handoff in one process (handoff.py) and across two llama-server processes (server.py). The only package that
imports llama.cpp's bindings (llamacpp.py)."""
