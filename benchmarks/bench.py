"""Run ``forget bench`` from a checkout: ``python benchmarks/bench.py --quick``.

The same as ``python -m forget bench``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import sys

from forget._cli._bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
