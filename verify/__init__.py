"""An independent checker of finished runs (``cpr verify``). It imports nothing of the
product (``core``, ``actors``, ``app``, ``policies``): it reads the files other processes
wrote, and recomputes what it needs of the run with its own code (``verify.replay``)."""

from verify.run import Verdict, verify_run

__all__ = ["Verdict", "verify_run"]
