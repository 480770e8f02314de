"""Writing minillm models in other runtimes' formats: GGUF for llama.cpp (``export.gguf``)."""
