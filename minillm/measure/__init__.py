"""Measures and models (chapters 2-3): latency and throughput metrics, goodput under an SLO,
MFU/MBU, the roofline's counted FLOPs and bytes, the chapter-2 replay of requests served one at a
time, quality; the one timing harness (``timing``) and the provenance record, results store and
tables every benchmark and chapter prints (``report``).
"""
