"""A command's figures: its tables printed, the figures written to ``--json`` if asked and saved
(``measure.report.save_result``) unless ``--no-save``, under $MINILLM_RESULTS or ./minillm-results
(``measure.report.user_results``), never into the package; every benchmark (and ``train gqa``)
ends here, so every one saves the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from ..measure import report
from .common import CliError


def write_json(path: Path, figures: Mapping) -> None:
    """Write a command's figures to the JSON file it was given, and say where."""
    report.write_json(path, figures)
    print(f"figures written to {path}")


def report_figures(
    args: argparse.Namespace, figures: Mapping, text: str, device: str | None = None, save: bool = True
) -> int:
    """Print a command's tables, write its figures to --json, and save them to the results store
    as ``args.result_name`` (``output_options``) unless --no-save or ``save`` is false (a quick
    run's figures are a test, not a result). ``device`` names the hardware folder when the figures
    do not say it themselves."""
    print(text)
    try:
        if args.json:
            write_json(args.json, figures)
        if save and not args.no_save:
            hardware = report.hardware_slug(device) if device else None
            path = report.save_result(args.result_name, figures, hardware, report.user_results())
            print(f"figures saved to {path}")
    except OSError as e:  # a folder it cannot write (report.write_json says what to set): one line
        raise CliError(f"figures not written: {e}") from None
    return 0


def run_benchmark(
    args: argparse.Namespace,
    what: str,
    run: Callable[[], Mapping],
    format_: Callable[[Mapping], str],
    errors: tuple[type[Exception], ...] = (ValueError,),
    save: bool = True,
) -> int:
    """``bench NAME`` once its options are checked: say ``what`` it measures (on stderr), ``run()``
    it, each of ``errors`` one line (``bench NAME: why``), then report its figures."""
    print(what, file=sys.stderr, flush=True)
    try:
        figures = run()
    except errors as e:
        raise CliError(f"bench {args.benchmark}: {e}") from None
    return report_figures(args, figures, format_(figures), save=save)
