"""Ctrl-C (SIGINT, a Jupyter kernel interrupt) deferred over the part of a step that must not be cut in two.

The train step donates the model's and optimizer's buffers to XLA and NNX writes the new ones back afterwards; an
interrupt landing between the two would leave a model whose arrays are deleted. :func:`deferred_sigint` holds a
SIGINT that arrives inside its block and delivers it (``KeyboardInterrupt``) when the block ends, so an interrupted
step either did not update anything or finished its update and weight sync: the trainer stays usable.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


@contextlib.contextmanager
def deferred_sigint():
    """Run the block with SIGINT held; a SIGINT received meanwhile is re-delivered to the previous handler at the end
    (``KeyboardInterrupt`` under Python's default handler), with a note on stderr when it arrives; a second SIGINT
    raises at once. A no-op off the main thread (signals go to the main thread) and when SIGINT is ignored
    (``SIG_IGN``: background jobs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.getsignal(signal.SIGINT)
    if prev in (signal.SIG_IGN, None):
        yield
        return
    received: list = []

    def hold(signum, frame):
        if received:  # a second Ctrl-C: the user means it (a hung sync, a long compile): stop now
            signal.signal(signal.SIGINT, prev)
            raise KeyboardInterrupt
        received.append((signum, frame))
        print("\nCtrl-C: stopping after this step's update and weight sync (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
        if received and sys.exc_info()[0] is None:  # an exception from the block itself is not masked
            if prev is signal.SIG_DFL or not callable(prev):
                raise KeyboardInterrupt
            prev(*received[0])
