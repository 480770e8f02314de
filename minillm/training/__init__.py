"""The bundled corpus (Python's own documentation and standard library), its tokenizer, and the
training loop that made the two bundled models.
"""
