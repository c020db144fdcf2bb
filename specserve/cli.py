"""Command-line entry point: ``specserve <command> ...``.

Each command lives in its own module, which exposes ``add_parser(subparsers)``;
the module is imported only when its command runs or its help is asked for, so
``specserve bench`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from specserve.errors import SpecserveError

# command name -> module that defines add_parser(subparsers)
COMMANDS: dict[str, str] = {
    "generate": "specserve.commands.generate",
    "serve": "specserve.commands.serve",
    "models": "specserve.commands.models",
    "pull": "specserve.commands.models",
    "bench": "specserve.bench.cli",
    "lock": "specserve.lock.cli",
    "verify": "specserve.lock.cli",
    "plan": "specserve.commands.plan",
    "train-drafter": "specserve.commands.train_drafter",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="An LLM inference server built around "
                                     "lossless speculative decoding, and its tools.")
    from specserve import __version__

    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    for name, modname in COMMANDS.items():
        if only is not None and name != only:
            continue
        if modname in seen:
            continue
        try:
            module = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("specserve"):
                continue  # command not built yet
            raise
        seen.add(modname)
        module.add_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = DefaultsHelpFormatter
    parser.commands = sub.choices  # name -> the command's parser, which names its own unknown flags
    return parser


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """A command's --help names each flag's default (as vLLM's and llama-server's do), unless the
    flag's own help already says it or there is none to name (unset, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS or default in ("", [])
        if not action.option_strings or unset or "default" in text.lower():
            return text
        return text + " (default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # also while the command's modules import (torch takes a moment)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=command if command in COMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's own parser (its usage, not the top-level one)
        (parser.commands.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except SpecserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
