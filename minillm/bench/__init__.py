"""Benchmarks: one module per topic, each a function that returns its figures (with the one
provenance record of ``report``) and a ``format_*`` that prints them; ``timing`` is the only
timing loop; ``cli`` is ``python -m minillm bench``. Results live in minillm/results/<hardware>/<name>.json.
"""
