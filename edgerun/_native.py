"""The native extension, loaded so that the process holds one llama.cpp.

llama-cpp-python opens libllama by its file path; the extension (native/, built as _native_ext)
links it by its soname. The wheel ships both names as separate files, so an extension loaded
first would bring a second copy of llama.cpp into the process: two backend registries (two CUDA
initializations), two log hooks, and a sampler made by one copy failing the other's type check.
Opened first, llama_cpp's copy is the one the extension's soname resolves to."""

import llama_cpp  # noqa: F401  (must precede the extension)

from edgerun._native_ext import *  # noqa: E402,F401,F403
