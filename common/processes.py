"""Child processes that must not outlive the process that started them."""

import ctypes
import os
import signal


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when `parent` dies (kill -9 included); call it in the child, first thing
    (a subprocess's preexec_fn, a multiprocessing target).

    The signal follows the *thread* that forked this process: start it from a thread that lives as long as the
    child should (the main thread, or a pool thread that waits for it). Not Linux/glibc: nothing is set and the
    caller's own way of noticing (a closed pipe, a poll) applies.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
