"""How fast one core runs Python while other cores are busy: the machine's own scaling.

bench/scale.py compares N data planes with N times one process. That ratio can reach N only
where N busy cores each run as fast as one busy core alone. A virtual machine's cores may be
hyperthreads of shared physical cores, or share a power budget (turbo clocks fall as more cores
run), or share the host with other guests. This measures it with no router at all: K processes,
each pinned to a core of its own, count the turns of a bare Python loop over the same seconds;
the table gives each K's turns per process against one process alone, on the router cores that
bench/scale.py would use and then on every core (as a scale run loads the whole machine).

    .venv/bin/python bench/core_speed.py                       # bench/scale.py's router cores
    .venv/bin/python bench/core_speed.py --router-cores 6 --seconds 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from proc_cpu import pinned
from scale import cpu_list, default_router_cores, plan_cores

START_DELAY_S = 0.5
SPIN = """
import sys, time
start, seconds = float(sys.argv[1]), float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
end, turns = time.perf_counter() + seconds, 0
while time.perf_counter() < end:
    turns += 1
print(turns)
"""


def spin(cores: Sequence[int], seconds: float) -> list[int]:
    """Loop turns of one spinner per core, all running over the same ``seconds``."""
    start = time.time() + START_DELAY_S
    argv = [sys.executable, "-c", SPIN, f"{start:.3f}", str(seconds)]
    spinners = [
        subprocess.Popen(pinned(argv, [core]), stdout=subprocess.PIPE, text=True) for core in cores
    ]
    return [int(spinner.communicate()[0]) for spinner in spinners]


def layouts(router: Sequence[int], every: Sequence[int]) -> list[tuple[int, ...]]:
    """1, 2, 4 ... of the router cores, all of them, then every core of the machine."""
    counts = sorted({1, *(k for k in (2, 4) if k < len(router)), len(router)})
    chosen = [tuple(router[:k]) for k in counts]
    return chosen if tuple(every) in chosen else [*chosen, tuple(every)]


def main(argv: Sequence[str] | None = None) -> int:
    available = sorted(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--router-cores",
        type=int,
        default=default_router_cores(len(available)),
        help="as bench/scale.py: the highest-numbered cores (default %(default)s here)",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved, per layout")
    args = parser.parse_args(argv)
    if len(available) < 2:
        parser.error("needs at least 2 cores")
    router = plan_cores(available, min(args.router_cores, len(available) - 1)).router
    turns: dict[tuple[int, ...], list[float]] = {cores: [] for cores in layouts(router, available)}
    for _ in range(args.rounds):
        for cores, means in turns.items():
            means.append(statistics.mean(spin(cores, args.seconds)))
    alone = statistics.mean(next(iter(turns.values())))
    rounds = f"{args.rounds} interleaved rounds of {args.seconds:g} s"
    print(f"{len(available)} cores; router cores {cpu_list(router)}; {rounds}")
    print()
    print("| busy cores | which | loop turns per process vs one alone (each round) |")
    print("|---:|---|---:|")
    for cores, means in turns.items():
        rounds = " / ".join(f"{mean / alone:.2f}" for mean in means)
        which = "every core" if list(cores) == available else f"router cores {cpu_list(cores)}"
        print(f"| {len(cores)} | {which} | {statistics.mean(means) / alone:.2f} ({rounds}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
