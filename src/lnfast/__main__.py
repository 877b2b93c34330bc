"""Command line: `python -m lnfast check | bench | config`."""
import argparse
import sys


def _seed(text):
    """--seed: an integer >= 0 (NumPy's random generators take no other)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def main(argv=None):
    import lnfast

    parser = argparse.ArgumentParser(prog="python -m lnfast")
    parser.add_argument("--version", action="version", version=f"lnfast {lnfast.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="self-test every function against float64")
    check.add_argument("--seed", type=_seed, default=None)
    sub.add_parser("config", help="print the build configuration")
    bench = sub.add_parser("bench", help="time lnfast against NumPy (and PyTorch)")
    from lnfast import _bench

    _bench.add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "bench":
        _bench.check_arguments(bench, args)

    if args.command == "config":
        lnfast.show_config()
        return 0
    try:                        # (bench --threads sets the count: the variable is not read)
        if args.command == "check" or args.threads is None:
            lnfast.get_num_threads()
    except ValueError as e:     # (a bad LNFAST_NUM_THREADS: every call would raise it)
        print(f"python -m lnfast {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "check":
        from lnfast import _selftest

        return 0 if _selftest.run(args.seed) else 1
    try:
        return _bench.run(args)
    except MemoryError:         # (shapes past this machine's memory)
        print("python -m lnfast bench: not enough memory for these shapes", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
