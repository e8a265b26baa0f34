"""An independent checker of finished runs (``cpr verify``). It imports nothing of the
product's Ray layer (``actors``) or drivers (``app``), and from ``core`` only the step
schedule (which cached microbatch a step uses); it reads the files other processes wrote."""

from verify.run import Verdict, verify_run

__all__ = ["Verdict", "verify_run"]
