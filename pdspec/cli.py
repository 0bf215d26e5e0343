"""The `pdspec` command line."""

from __future__ import annotations

import argparse

from sampling import demo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdspec", description="pdspec command line")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="rejection-sampling demo: measured vs theoretical acceptance", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        demo.main(rest)


if __name__ == "__main__":
    main()
