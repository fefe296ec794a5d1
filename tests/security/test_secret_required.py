"""No default secret: a KVManager, a BootstrapServer and `kvxfer bootstrap` refuse to start
without one (``secret=`` or ``$KVXFER_SECRET``). Before, KVManager fell back to the public
``b"kvxfer"`` and the bootstrap server took no secret at all."""

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from kvxfer import BootstrapServer, KVArgs, KVManager
from kvxfer.config import SECRET_ENV, resolve_secret
from kvxfer.disagg import bootstrap
from kvxfer.errors import AuthenticationFailed, InvalidArgument

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def args():
    kv = np.zeros(4 * 64, dtype=np.uint8)
    aux = np.zeros(4 * 16, dtype=np.uint8)
    a = KVArgs(
        kv_data_ptrs=[int(kv.ctypes.data)],
        kv_data_lens=[kv.nbytes],
        kv_item_lens=[64],
        aux_data_ptrs=[int(aux.ctypes.data)],
        aux_data_lens=[aux.nbytes],
        aux_item_lens=[16],
        page_size=1,
        dtype="uint8",
    )
    a._keep = (kv, aux)
    return a


def test_no_secret_no_manager_no_server(args, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(InvalidArgument, match=SECRET_ENV):
        KVManager(args, "decode")
    with pytest.raises(InvalidArgument, match=SECRET_ENV):
        KVManager(args, "prefill", bootstrap_addr="127.0.0.1:1")
    with pytest.raises(InvalidArgument, match=SECRET_ENV):
        BootstrapServer(port=0)
    with pytest.raises(InvalidArgument, match="non-empty"):
        KVManager(args, "decode", secret=b"")


def test_secret_from_the_caller_or_the_environment(args, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert KVManager(args, "decode").secret == b"from-env"
    assert KVManager(args, "decode", secret=b"given")._engine_kw["secret"] == b"given"
    assert resolve_secret("text", "x") == b"text"


def test_cli_bootstrap_refuses_without_a_secret(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    env["PYTHONPATH"] = os.getcwd()
    p = subprocess.run(
        [sys.executable, "-m", "kvxfer", "bootstrap", "--host", "127.0.0.1", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert p.returncode == 2 and SECRET_ENV in p.stderr, (p.returncode, p.stdout, p.stderr)


def test_cli_bootstrap_serves_only_holders_of_the_secret_file(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"file-secret\n")
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    env["PYTHONPATH"] = os.getcwd()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvxfer",
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--secret-file",
            str(secret_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = p.stdout.readline()
        assert "listening on" in line, (line, p.stderr.read() if p.poll() is not None else "")
        addr = line.split()[-1]
        assert asyncio.run(bootstrap.lookup(addr, 0, 5, secret=b"file-secret")) == []
        with pytest.raises(AuthenticationFailed):
            asyncio.run(bootstrap.lookup(addr, 0, 5, secret=b"kvxfer"))  # the old default
    finally:
        p.terminate()
        p.wait(10)
