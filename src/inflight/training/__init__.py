"""Training-side helpers (torch only): sequence packing (``training.pack``)."""
