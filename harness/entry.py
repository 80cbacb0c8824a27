"""The ``ppspec`` console entry point (also ``python -m harness``).

It holds SIGINT and SIGTERM from its first line, before the CLI's own imports (Typer, Rich and the command
modules: most of a second on a loaded machine), then runs :func:`harness.cli.main`, which installs the CLI's
handlers and ends a held signal with the one interrupt line and exit 128 + the signal number. Only the
interpreter's start (up to about a tenth of a second on a loaded machine) runs under Python's default handler.
Imports nothing but the standard library's ``signal`` before :mod:`harness.cli`.
"""
from __future__ import annotations

import signal


def main() -> None:
    """Hold SIGINT / SIGTERM while :mod:`harness.cli` imports, then run :func:`harness.cli.main` with them."""
    held: list[int] = []

    def hold(signum: int, frame) -> None:
        held.append(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, hold)
    from harness import cli
    cli.main(held)


if __name__ == "__main__":
    main()
