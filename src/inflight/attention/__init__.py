"""Attention backends over the paged KV cache."""
