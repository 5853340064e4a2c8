"""End-to-end decoding benchmark (default: the default pair), results into bench/results/: `specengine bench`
(specengine/devtools/benchmark.py) with bench/results/ as its output folder.

    python bench/bench_e2e.py [--quick] [--prompts 32] [--new-tokens 128] [--repeats 3] [--gammas ...]
"""
import sys

from specengine.cli import main

from common import RESULTS

if __name__ == "__main__":
    sys.exit(main(["bench", "--out-dir", str(RESULTS), *sys.argv[1:]]))
