"""``cpr verify --replay`` on a finished run, as the tests call it: the log checks' verdict,
with the replay's findings (and anything it could not replay) among its violations."""

from __future__ import annotations

from verify import Verdict, verify_run
from verify.replay.engine import replay_dir

__all__ = ["verified"]


def verified(run_dir, wait_s: float = 30.0) -> Verdict:
    verdict = verify_run(run_dir, wait_s)
    replayed = replay_dir(run_dir)
    verdict.violations += [f"replay: {f}" for f in replayed.findings]
    verdict.violations += [f"not replayed: {g}" for g in replayed.gaps]
    verdict.facts["replay"] = replayed
    return verdict
