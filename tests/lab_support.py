"""start_lab(root): a JupyterLab server on 127.0.0.1 over ``root`` for the browser tests."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_lab(root):
    """Serve ``root`` with JupyterLab (settings, runtime and workspaces kept inside it);
    yields ``(url, token)``; the server is stopped on exit."""
    settings = root / ".settings"
    for path, value in {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                           "checkForUpdates": False},
    }.items():
        (settings / path).parent.mkdir(parents=True, exist_ok=True)
        (settings / path).write_text(json.dumps(value))
    port, token = _free_port(), "workbench-test"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(root / ".config"), "JUPYTER_RUNTIME_DIR": str(root / ".rt"),
           "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(root / ".ws"),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    log = open(root / ".lab.log", "w")  # a pipe nobody reads could fill and stall the server
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start: {(root / '.lab.log').read_text()[-2000:]}")
            time.sleep(0.5)
    try:
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
