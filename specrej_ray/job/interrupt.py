"""SIGTERM and SIGINT as a clean stop: what schedulers, `ray job stop` and Ctrl-C send.

The first signal asks the job to stop. Before `defer()` (prompts loading, Ray and the actors
starting) it raises `Interrupted` at once: nothing there is worth finishing. After it (the
shard loop, then the writing of what is finished) it only sets a flag that the loop polls,
except inside `at_once()`: the start-up's slow steps (imports, models, prompts, Ray's
start), safe to cut short.
A second signal exits at once, with the same code. Ray-free: the driver re-installs the
handlers after `ray.init`, which puts in its own (those end the driver with an abort dump).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """What a shell reports for a process ended by this signal: 143 SIGTERM, 130 SIGINT."""
    return 128 + signum


class Interrupted(BaseException):
    """The job was stopped by a signal. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way up swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Interrupt:
    """Installed signal handlers and the flag they set; `restore()` puts the old ones back."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.raised = False  # whether the handler raised Interrupted for it
        self._deferring = False
        self._again = False  # the first signal, delivered again by _unraisable
        self._previous: dict[int, object] = {}
        self._previous_hook: Callable | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> Interrupt:
        """(Re)install the handlers; the handlers found the first time are what restore()
        puts back. Only the main thread may do this (a signal module rule)."""
        for signum in SIGNALS:
            old = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, old)
        if self._previous_hook is None:
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def restore(self) -> None:
        for signum, old in self._previous.items():
            signal.signal(signum, old)  # type: ignore[arg-type]
        self._previous.clear()
        if self._previous_hook is not None:
            sys.unraisablehook, self._previous_hook = self._previous_hook, None

    def reinstall(self) -> None:
        """Put the handlers back over those another library set (ray.init sets its own);
        nothing if they were never installed."""
        if self._previous:
            self.install()

    def defer(self) -> None:
        """From now on a first signal only sets the flag: the caller polls `requested`."""
        self._deferring = True

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Within the block a first signal raises Interrupted at once, even after defer():
        for a wait that is safe to cut short and may be long (Ray's start). A signal that
        came before the block raises on entry; one whose Interrupted the code inside
        swallowed is still `requested` after it."""
        self.check()
        deferring, self._deferring = self._deferring, False
        try:
            yield
        finally:
            self._deferring = deferring

    def check(self) -> None:
        """Raise Interrupted if a signal came."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def _handle(self, signum: int, frame) -> None:
        if self._again:
            if _inside(frame, Interrupt._unraisable):  # not in the hook that asked for it
                self._deliver_again(signum)
                return
            self._again = False
            if not self._deferring:
                self._raise(signum)
            return
        if self.signum is not None:  # the second one: the user means it
            name = signal.Signals(signum).name
            os.write(2, f"specrej-ray: second {name}; exiting now\n".encode())
            os._exit(exit_code(self.signum))
        self.signum = signum
        if not self._deferring:
            self._raise(signum)

    def _raise(self, signum: int) -> None:
        self.raised = True
        raise Interrupted(signum)

    def _unraisable(self, unraisable) -> None:
        """Our Interrupted, raised where Python cannot pass it on: in a callback it calls
        from C, such as an at-fork hook (a signal that comes while Ray forks one of its
        processes lands in logging's), or a __del__. Python would print it as a traceback
        and carry on; it is delivered again instead, once this hook is over."""
        if not isinstance(unraisable.exc_value, Interrupted):
            (self._previous_hook or sys.__unraisablehook__)(unraisable)
            return
        self._again = True
        self._deliver_again(unraisable.exc_value.signum)

    @staticmethod
    def _deliver_again(signum: int) -> None:
        # From a thread, a moment later: the main thread's handler runs at its next line of
        # Python, which should not be in the hook (_handle checks).
        def later() -> None:
            time.sleep(0.005)
            _thread.interrupt_main(signum)

        threading.Thread(target=later, name="specrej-stop-again", daemon=True).start()


def _inside(frame, function: Callable) -> bool:
    """Whether `function` is running on the stack that `frame` is the top of."""
    while frame is not None:
        if frame.f_code is function.__code__:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def handling_signals() -> Iterator[Interrupt]:
    """Handlers installed for the block, restored after it.

    An error that leaves the block after the handler raised Interrupted is that stop: the
    Interrupted landed in C code that replaced it with an error of its own (numpy's C
    extensions, imported when the signal came, raise an ImportError instead), and the
    command must end as stopped (143, 130), not with that error's traceback and 1."""
    stop = Interrupt().install()
    try:
        yield stop
    except Interrupted:
        raise
    except BaseException as e:
        if stop.raised:
            assert stop.signum is not None  # the handler raises only for a signal it records
            raise Interrupted(stop.signum) from e
        raise
    finally:
        stop.restore()
