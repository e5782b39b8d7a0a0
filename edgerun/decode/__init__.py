"""Decoding: sampling, the generate loop, and its statistics."""
