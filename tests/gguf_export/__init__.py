"""Test-side writers of tiny GGUF files that follow llama.cpp's converter conventions
(tensor names, metadata keys, tensor rewrites such as the llama Q/K permutation), one
module per llama.cpp architecture, built on ``common``."""
