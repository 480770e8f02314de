"""The command line (``python -m minillm COMMAND``, or ``minillm COMMAND`` once installed):
``main`` (the parser, generate, serve, models, corpus, train), ``bench`` (``minillm bench
BENCHMARK``: each benchmark's options and tables) and ``common`` (the one-line errors, the parser
class, devices, dtypes, threads). Each handler imports what it runs when it runs, so ``minillm
models`` or ``--help`` load no technique, server or benchmark.
"""
