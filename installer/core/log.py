"""The installer's voice: one prefixed line per message, on stderr and, under pip, on the terminal.

pip hides a successful build's output unless run with -v, yet the chosen asset (or why none was
chosen) must always be visible; so when stderr is captured and a controlling terminal exists, the
line also goes to /dev/tty.
"""

from __future__ import annotations

import sys

PREFIX = "cudelta: "


def say(message: str) -> None:
    line = PREFIX + message
    print(line, file=sys.stderr, flush=True)
    if not sys.stderr.isatty():
        try:
            with open("/dev/tty", "w") as tty:
                tty.write(line + "\n")
        except OSError:
            pass
