"""Making the KV cache smaller and cheaper (chapters 4-6, 11): the compressed cache kinds, GQA
conversion, paged KV blocks with prefix caching (by hash chain in ``paged``, by radix tree in
``radix``), the memory formulas, and the fixed-shape cache for compiled decoding.
"""
