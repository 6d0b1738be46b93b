"""The inference benchmark (same as `layerflow bench`): GPU/CPU/SSD hits, layerwise onboarding and its lower bound.

    PYTHONPATH=. python3 benchmarks/inference_benchmark.py --seq-lens 2K,4K,8K,16K --out r.json --plot r.png
"""

import argparse

from layerflow.bench.cli import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    main(parser.parse_args())
