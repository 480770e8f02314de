"""Measures and models with no timing of their own (chapters 2-3): latency and throughput metrics,
goodput under an SLO, MFU/MBU, the roofline's counted FLOPs and bytes, and the chapter-2 replay
of requests served one at a time.
"""
