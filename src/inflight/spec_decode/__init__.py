"""Speculative decoding: proposers guess the next tokens of running requests;
the runner verifies them all in one forward pass (see ``worker.model_runner``).
Plain Python, no torch: a proposer sees token ids only."""
