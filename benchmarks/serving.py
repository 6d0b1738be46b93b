"""The serving benchmark (same as `layerflow bench --serve`): Zipf returning users beyond the GPU pool, open-loop
Poisson arrivals at rising rates, in process and over HTTP, prefetch across batches off and on, and the rate at which
the copy engine or the GPU saturates.

    PYTHONPATH=. python3 benchmarks/serving.py --out benchmarks/results/serving-h200.json \\
        --plot benchmarks/results/serving-h200.png
"""

import argparse
import sys

from layerflow.bench.cli import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    main(parser.parse_args(["--serve", *sys.argv[1:]]))
