"""``python -m tests.torch_suite``: see runner.py."""

import argparse
import sys

from tests.torch_suite import runner


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.torch_suite", description=runner.__doc__.split("\n")[0]
    )
    ap.add_argument("--world-size", type=int, action="append", choices=runner.WORLD_SIZES)
    ap.add_argument("-k", dest="keyword", help="pytest -k expression (a subset of the suite)")
    ap.add_argument("--write-known", action="store_true", help="rewrite known.tsv from this run")
    args = ap.parse_args()
    sizes = args.world_size or list(runner.WORLD_SIZES)
    known = runner.load_known()
    results, bad = {}, 0
    for ws in sizes:
        got = results[ws] = runner.run(ws, keyword=args.keyword)
        counts = {
            k: sum(o.outcome == k for o in got.values()) for k in ("passed", "skipped", "failed")
        }
        print(
            f"world size {ws}: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed"
        )
        diffs = (
            runner.differences(ws, got, known)
            if not args.keyword
            else [d for d in runner.differences(ws, got, known) if "not in torch's suite" not in d]
        )
        for d in diffs:
            print(f"  {d}")
        bad += len(diffs)
    if args.write_known:
        runner.write_known(results)
        print(f"wrote {runner.KNOWN_PATH}")
    return 1 if bad and not args.write_known else 0


if __name__ == "__main__":
    sys.exit(main())
