"""Time and peak memory of `autopar analyze` on an 80-layer 70B-shaped Llama on "meta".

    python bench/analyze_70b.py            # 3 runs, medians
    python bench/analyze_70b.py --repeat 5

Runs the CLI exactly as a user would, in a fresh process each time, and reads the
child's wall time and peak RSS. The weights are never allocated (140 GB in bf16):
the model lives on "meta" and the trace runs on FakeTensors.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CMD = [sys.executable, "-m", "autopar.cli", "analyze", "examples/llama.py:build", "--arg", "size=70b",
       "--cluster", "64x8xH100"]


def one_run() -> tuple[float, float]:
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child: exec the CLI so its RSS is its own
        os.chdir(ROOT)
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            os.dup2(devnull.fileno(), 2)
        os.execv(sys.executable, CMD)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(CMD)} failed; run it by hand to see why")
    return wall, usage.ru_maxrss / 1e6  # Linux reports kB


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs = [one_run() for _ in range(args.repeat)]
    walls, rss = [r[0] for r in runs], [r[1] for r in runs]
    print(f"{' '.join(CMD[2:])}")
    print(f"wall s: median {statistics.median(walls):.1f} (runs: {', '.join(f'{w:.1f}' for w in walls)})")
    print(f"peak RSS GB: median {statistics.median(rss):.2f} (runs: {', '.join(f'{r:.2f}' for r in rss)})")


if __name__ == "__main__":
    main()
