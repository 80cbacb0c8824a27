"""The ``ppspec`` console entry point (also ``python -m harness``).

It holds SIGINT and SIGTERM from its first line, before the CLI's own imports (Typer, Rich and the command
modules: most of a second on a loaded machine), then runs :func:`harness.cli.app.main`, which installs the CLI's
handlers and ends a held signal with the one interrupt line and exit 128 + the signal number. Only the
interpreter's start (0.1 to 0.3 s on a loaded machine) is out of reach: a SIGINT before Python installs its handler
ends the process silently (killed by the signal: 130 to the shell), one during ``site`` (the ``.pth`` files of
site-packages, an editable install among them) ends in CPython's "Fatal Python error: init_import_site".
Imports nothing but the standard library's ``signal`` before :mod:`harness.cli.app`.
"""
from __future__ import annotations

import signal


def main() -> None:
    """Hold SIGINT / SIGTERM while :mod:`harness.cli.app` imports, then run :func:`harness.cli.app.main` with them."""
    held: list[int] = []

    def hold(signum: int, frame) -> None:
        held.append(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, hold)
    from harness.cli import app as cli
    cli.main(held)


if __name__ == "__main__":
    main()
