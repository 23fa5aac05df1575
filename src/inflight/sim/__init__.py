"""The simulator: the real scheduler, KV cache manager and policies driven in
virtual time by a cost-model runner; no torch on this path."""
