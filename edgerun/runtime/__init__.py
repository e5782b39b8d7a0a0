"""Runtime: llama.cpp through llama-cpp-python's low-level API, placement, logging."""
