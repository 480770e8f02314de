"""Benchmarks: one module per topic, each a function that returns its figures (with the
provenance record of ``minillm.measure.report``) and a ``format_*`` that prints them, timed by
``minillm.measure.timing``; ``python -m minillm bench`` is ``minillm.cli.bench``. Results live in
minillm/results/<hardware>/<name>.json.
"""
