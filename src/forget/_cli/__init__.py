"""Command-line interface: ``forget demo | bench | plan | profile``.

Each subcommand lives in its own module and is imported only when it runs,
so ``forget --help`` stays fast and optional extras stay optional.

NOTE [kineto's log]: torch's profiler library (kineto), which measures the
allocator's peak on CPU, writes a ``USDT: ... profiler_start`` and a
``... profiler_stop`` line to file descriptor 2 around every measured step,
across the progress bar and past ``--quiet``. ``KINETO_LOG_LEVEL=6`` silences
them when set before the process's first profiler starts. Only the process's
owner may set that, so the command line does, at its entry, where the user has
not set it; the library leaves the environment and the descriptors alone.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help). Each module exposes ``main(argv) -> int``.
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "forget._cli._demo",
        "train a small model plain and with forget; compare bytes and state",
    ),
    "bench": ("forget._cli._bench", "benchmark plain vs torch.utils.checkpoint vs forget"),
    "plan": ("forget._cli._plan", "plan a model into a memory budget"),
    "profile": ("forget._cli._profile", "memory ledger and plan for a user's model factory"),
}


def _usage() -> str:
    lines = ["usage: forget COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "Run `forget COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # NOTE [kineto's log]
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in _COMMANDS:
        print(f"forget: unknown command {name!r}; expected one of {', '.join(_COMMANDS)}.")
        print(_usage())
        return 2
    module = importlib.import_module(_COMMANDS[name][0])
    status: int = module.main(rest)
    return status
