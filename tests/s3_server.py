"""A real S3 API server for the tests: moto's standalone server (installed from the package
registries), in its own process, on 127.0.0.1 or on an address inside a network namespace
that a test created. pyarrow reaches it with ``endpoint_override`` and ``scheme=http``."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs

# What every test process and Ray worker uses: moto accepts any credentials; without them
# (and with instance metadata off) pyarrow would look for real ones.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def moto_argv(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)]


def wait_until_running(log: Path, timeout_s: float = 30.0) -> int:
    """The port moto says it runs on, from its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"Running on http://[\d.]+:(\d+)", log.read_text() if log.exists() else "")
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    raise TimeoutError(f"moto did not start: {log.read_text()[-2000:] if log.exists() else ''}")


class S3Server:
    """moto on ``host`` in this process's network namespace, started and stopped by a fixture."""

    def __init__(self, log: Path, host: str = "127.0.0.1"):
        self.host = host
        self.log = log
        self._proc = subprocess.Popen(moto_argv(host, 0), stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.port = wait_until_running(log)

    def uri(self, path: str) -> str:
        return f"s3://{path}?endpoint_override={self.host}:{self.port}&scheme=http&region=us-east-1"

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(endpoint_override=f"{self.host}:{self.port}", scheme="http", region="us-east-1",
                                 access_key="testing", secret_key="testing", allow_bucket_creation=True)

    def bucket(self, name: str) -> str:
        self.filesystem().create_dir(name)
        return name

    def upload(self, local: Path, key: str) -> str:
        fs = self.filesystem()
        with fs.open_output_stream(key, compression=None) as out:
            out.write(Path(local).read_bytes())
        return self.uri(key)

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
