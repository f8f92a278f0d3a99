"""Where the sampled time went, from py-spy's collapsed stacks (``-f raw``).

    .venv/bin/python bench/spy_shares.py /tmp/pool.*.txt [--top 25]

Sums every file given (e.g. each pool host's, ``bench_ingress.py --profile-pool``) and
prints the share of samples under each function (inclusive, a function counted once a
sample however deep it recurs) and the share spent in each function itself (its own
frames, the stack's last). Functions are named by name and file, not line: the shares
of one function's lines together. py-spy samples busy threads (``--nonblocking``, no
``--idle``), so a share is of the work the processes did, not of the wall time.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

# "name (path/to/file.py:123)" -> "name (file.py)"
FRAME = re.compile(r"^(?P<name>.*?) \((?P<path>[^()]*?)(?::\d+)?\)$")


def function_of(frame: str) -> str:
    found = FRAME.match(frame)
    if found is None:
        return frame
    return f"{found['name']} ({Path(found['path']).name})"


def shares(paths: list[str]) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = [function_of(f) for f in stack.split(";")]
            for name in set(frames):
                inclusive[name] += n
            own[frames[-1]] += n
    return total, inclusive, own


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    total, inclusive, own = shares(args.files)
    if not total:
        raise SystemExit("no samples in the files given")
    print(f"{total} samples from {len(args.files)} file(s)")
    print("inclusive:")
    for name, n in inclusive.most_common(args.top):
        print(f"  {n / total:6.1%}  {name}")
    print("own:")
    for name, n in own.most_common(args.top):
        print(f"  {n / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
