"""Serving many requests (chapter 13): chat-like workloads, the scheduler (static, dynamic,
continuous batching, chunked prefill, preemption) and the engine that runs its steps on paged KV.
"""
