"""The model and what every chapter builds on (chapters 1 and 4): the configuration and shape
presets, the transformer, attention (reference, SDPA, tiled, the Triton backend), the KV-cache
protocol and the contiguous cache, sampling, generation, checkpoints, the tokenizer, and naming
the device. ``core`` imports no other part of minillm.
"""
