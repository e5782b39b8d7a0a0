"""edgerun convert: an HF checkpoint or F16 GGUF into mixed-precision k-quants chosen by measurement."""
