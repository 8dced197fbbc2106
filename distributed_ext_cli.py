"""The console entries of ``distributed-ext-bench`` and ``distributed-ext``, outside the package on purpose.

Importing ``distributed_ext`` imports torch (a second or more): a Ctrl-C then would print a
traceback from deep inside an import. This module imports nothing heavy itself, so it can
catch that interrupt and say plainly that nothing ran.
"""

from __future__ import annotations

import os
import signal
import sys


def bench() -> int:
    """``distributed-ext-bench``: :func:`distributed_ext.bench.main`, quiet on Ctrl-C."""
    # The handler notes the interrupt as well as raising it: some import on the way catches
    # every exception (KeyboardInterrupt included) and goes on, which would run the bench
    # after a Ctrl-C.
    interrupted = []

    def note_interrupt(signum: int, frame: object) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note_interrupt)
    try:
        from distributed_ext.bench import main
    except KeyboardInterrupt:
        interrupted.append(signal.SIGINT)
    except BaseException:
        # An import the interrupt cut short can fail later as something else (numpy's C
        # module loaded again after a half-done first load: an ImportError): the Ctrl-C.
        if not interrupted:
            raise
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        print("\ndistributed-ext-bench: interrupted while starting; nothing ran",
              file=sys.stderr, flush=True)
        # Leave at once: the interpreter's shutdown with half-imported extension modules
        # can end the process by SIGINT after all (exit -2 seen), hiding this exit code.
        os._exit(130)
    return main()


def tools() -> int:
    """``distributed-ext``: its subcommands (``convert``: :mod:`distributed_ext.convert_cli`)."""
    try:
        from distributed_ext.convert_cli import main
    except KeyboardInterrupt:
        print("\ndistributed-ext: interrupted while starting; nothing ran", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(bench())
