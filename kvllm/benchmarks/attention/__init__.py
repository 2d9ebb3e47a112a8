"""`kvllm bench attention`: every attention backend valid here and the peer kernels, checked against the
float32 reference before they are timed (main.py: CLI and table; backends.py; peers.py; shapes.py)."""
