"""Command line: `python -m lnfast check | bench | config`."""
import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m lnfast")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="self-test every function against float64")
    check.add_argument("--seed", type=int, default=None)
    sub.add_parser("config", help="print the build configuration")
    bench = sub.add_parser("bench", help="time lnfast against NumPy (and PyTorch)")
    from lnfast import _bench

    _bench.add_arguments(bench)
    args = parser.parse_args(argv)

    if args.command == "check":
        from lnfast import _selftest, get_num_threads

        try:
            get_num_threads()
        except ValueError as e:     # (a bad LNFAST_NUM_THREADS: every call would raise it)
            print(f"python -m lnfast check: {e}", file=sys.stderr)
            return 2
        return 0 if _selftest.run(args.seed) else 1
    if args.command == "config":
        import lnfast

        lnfast.show_config()
        return 0
    return _bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
