"""The benchmarks: ``relattn bench`` (:mod:`.cli`, :mod:`.config`, :mod:`.run`), how anything is measured
(:mod:`.measure`), and the implementations relattn is compared with (:mod:`.peers`). Built on the library; the
library never imports it."""

from .cli import add_arguments, config_from_args, format_table, plot, write_results
from .config import PRESETS, BenchConfig
from .run import run_bench

__all__ = ["PRESETS", "BenchConfig", "add_arguments", "config_from_args", "format_table", "plot", "run_bench",
           "write_results"]
