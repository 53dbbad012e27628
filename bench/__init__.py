"""Benchmarks. `make bench` runs them; figures are printed beside the raw ceilings measured in
the same run, as ratios, because these 2-core machines are noisy."""

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path


def command_line(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace], Awaitable[dict]],
                 report: Callable[[dict], None]) -> None:
    """A bench's command line: the parser's options and ``--json PATH``; runs ``main(args)``,
    prints its ``report`` and writes the figures to PATH when given."""
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
