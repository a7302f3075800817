"""Command line: ``nblaunch`` (or ``python -m nblaunch``).

- ``nblaunch launch [options] script.py [args]`` / ``-m module``: a script on several processes.
- ``nblaunch test``: a self-check of this machine.
- ``nblaunch env``: versions and devices for a bug report.
- ``nblaunch demo``: train the demo on several processes.
- ``nblaunch ls``, ``nblaunch attach [ID]``, ``nblaunch stop ID``: detached launches.

Exit status: 0 success; 1 a rank failed (printed once, the details in the launch's log);
2 a usage error; 124 ``--timeout`` ran out; 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys

from nblaunch.contract.version import __version__
from nblaunch.cli import demo_command, detached, env, launch, selftest

_DESCRIPTION = "nblaunch: start PyTorch training on several processes, from a notebook or a terminal."
_COMMANDS = {"launch": launch, "test": selftest, "env": env, "demo": demo_command, "ls": detached.LIST,
             "attach": detached.ATTACH, "stop": detached.STOP}


def _program_name() -> str:
    # "python -m nblaunch" runs this file as __main__.py; the installed script is "nblaunch".
    return "python -m nblaunch" if os.path.basename(sys.argv[0]) == "__main__.py" else "nblaunch"


def build_parser() -> argparse.ArgumentParser:
    """The ``nblaunch`` command's arguments."""
    parser = argparse.ArgumentParser(prog=_program_name(), description=_DESCRIPTION, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"nblaunch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for module in _COMMANDS.values():
        module.add_parser(commands)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    script_args = None
    if argv[:1] == ["launch"]:  # the script's own arguments never meet the launcher's parser
        own, script_args = launch.split_at_script(_subparser(parser, "launch"), argv[1:])
        refused = launch.refused_prefix(own)
        if refused:
            print(f"{_program_name()} launch: error: {refused}", file=sys.stderr)
            return 2
        argv = ["launch", *own]
    options, unknown = parser.parse_known_args(argv)
    if script_args is not None:
        options.script_args = script_args
    if unknown:
        hint = " (the script's own options go after the script)" if options.command == "launch" else ""
        print(f"{_program_name()} {options.command}: error: unrecognized option {unknown[0]!r}{hint}; "
              f"see {_program_name()} {options.command} --help", file=sys.stderr)
        return 2
    return _COMMANDS[options.command].run(options)


if __name__ == "__main__":
    sys.exit(main())
