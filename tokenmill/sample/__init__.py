"""Turning logits into tokens: sampling, and verifying speculative drafts against the target."""
