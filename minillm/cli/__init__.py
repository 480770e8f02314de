"""The command line (``python -m minillm COMMAND``, or ``minillm COMMAND`` once installed), one
module per command: ``main`` (the parser tree, models, corpus, the entry point), ``generate``,
``serve``, ``train``, ``bench`` (``minillm bench BENCHMARK``: the in-process benchmarks) and
``bench_processes`` (those that start a server, workers or ranks). ``common`` holds what they share
(one-line errors, the parser class, devices, and each option several commands take, once, as a
parent parser); ``figures`` is the end of every benchmark (tables, ``--json``, the results store
unless ``--no-save``). Each handler imports what it runs when it runs, so ``minillm models`` or
``--help`` load no technique, server or benchmark.
"""
