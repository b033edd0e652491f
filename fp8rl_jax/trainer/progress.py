"""What a run shows while it works: the phase of the current step and its elapsed time on the progress bar.

The first step of a run compiles the rollout and train programs (minutes on a laptop CPU); without this the bar
sits at 0% with no sign of life. :class:`PhaseDisplay` is the trainer's ``on_phase`` callback: it puts
``"<phase> 12 s"`` in the bar's postfix and refreshes it once a second from a daemon thread.
"""

from __future__ import annotations

import threading
import time


class PhaseDisplay:
    """Show the current step phase with its elapsed seconds in a tqdm bar's postfix (refreshed every second).

    Args:
      bar: a ``tqdm`` bar (None: print each phase on its own line instead, flushed).
      first_step_note: appended while the first step runs (e.g. ``"first step: compiling"``).

    Use ``display(phase)`` as :attr:`fp8rl_jax.trainer.loop.RLTrainer.on_phase`; ``close()`` stops the ticker.
    """

    def __init__(self, bar=None, first_step_note: str = "the first step compiles"):
        self.bar, self.note = bar, first_step_note
        self.phase, self.t0 = None, time.perf_counter()
        self._stop = threading.Event()
        self._thread = None
        if bar is not None:
            self._thread = threading.Thread(target=self._tick, name="fp8rl-progress", daemon=True)
            self._thread.start()

    def __call__(self, phase: str) -> None:
        """Enter ``phase`` (e.g. ``"rollout"``, ``"train step"``, ``"export + sync"``)."""
        self.phase, self.t0 = phase, time.perf_counter()
        if self.bar is None:
            print(f"  {phase} ...", flush=True)
        else:
            self._show()

    def step_done(self) -> None:
        """A step finished: drop the first-step note."""
        self.note = ""

    def _show(self) -> None:
        if self.phase is None:
            return
        text = f"{self.phase} {time.perf_counter() - self.t0:.0f} s" + (f" ({self.note})" if self.note else "")
        self.bar.set_postfix_str(text, refresh=True)

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self._show()
            except Exception:  # noqa: BLE001 - a closed bar: stop quietly
                return

    def close(self) -> None:
        """Stop refreshing."""
        self._stop.set()
