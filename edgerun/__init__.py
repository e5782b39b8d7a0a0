"""edgerun: a local, offline-first LLM runner on llama.cpp."""

__version__ = "0.1.0"
