"""The ``gefen-bench`` command line.

Subcommands:
  train     real models on real data, Gefen vs its peers (the main job)
  arch      architecture-family matrix: fixed-batch memorisation, Gefen and AdamW
  step      optimizer-step micro-benchmark with a copy-bandwidth roofline
  memory    Gefen's state bytes/param on GPT-2- and Llama-3.2-1B-shaped parameter sets
  codebook  codebook-solver timing
  profile   per-kernel device time of one Gefen step, and the state census
  resume    Trainer-resume gate (docs/algorithm.md#distributed)
  fit       the largest Llama-shaped model each optimizer can train on this device
  digest    bit-exact fingerprints of Gefen's results, to compare two source trees

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> dict``.
Invalid options exit with status 2 and a message naming the option and the fix.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from ._version import __version__
from .optimizers import UnknownOptimizerError

SUBCOMMANDS = {
    "train": ("train", "train real models on real data with Gefen and its peers"),
    "arch": ("arch", "architecture-family matrix: memorise a fixed batch with Gefen and AdamW"),
    "step": ("step", "opt.step() micro-benchmark on GPT-2/Llama-3.2-1B-shaped parameters"),
    "memory": ("memory", "Gefen state bytes/param on GPT-2/Llama-3.2-1B-shaped parameters"),
    "codebook": ("codebook_timing", "time the exact optimal codebook solver"),
    "profile": ("profile_step", "per-kernel time of a Gefen step on GPT-2/Llama-3.2-1B shapes"),
    "resume": ("resume", "Trainer-resume gate: interrupted + resumed == uninterrupted"),
    "fit": ("fit", "the largest Llama-shaped model each optimizer can train on this device"),
    "digest": ("digest", "bit-exact fingerprints of Gefen's results, to compare source trees"),
}


def _load(module_name: str) -> ModuleType | ImportError:
    try:
        return importlib.import_module(f"gefen_bench.{module_name}")
    except ImportError as exc:
        return exc


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType | ImportError],
                            dict[str, argparse.ArgumentParser]]:
    """The top-level parser, per subcommand its module (or why it failed to import) and
    its parser."""
    parser = argparse.ArgumentParser(
        prog="gefen-bench",
        description="Measure Gefen against the optimizers users would pick instead.",
    )
    parser.add_argument("--version", action="version", version=f"gefen-bench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules: dict[str, ModuleType | ImportError] = {}
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = _load(module_name)
        modules[name] = module
        p = sub.add_parser(name, help=help_text, description=help_text)
        parsers[name] = p
        if isinstance(module, ModuleType):
            module.add_arguments(p)
    return parser, modules, parsers


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gefen-bench`` script; returns the exit status."""
    parser, modules, parsers = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = ["gefen-bench", *argv]
    if args.command is None:
        parser.print_help()
        return 2
    module = modules[args.command]
    if isinstance(module, ImportError):
        parsers[args.command].error(f"this subcommand's module failed to import: {module}")
    try:
        module.run(args)
    except (argparse.ArgumentTypeError, UnknownOptimizerError) as exc:
        parsers[args.command].error(str(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
