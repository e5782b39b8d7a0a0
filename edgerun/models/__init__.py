"""Models: the catalog, fetching, and GGUF validation."""
