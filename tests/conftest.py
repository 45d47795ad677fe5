"""Shared test setup: CPU-only, deterministic, Triton kernels through the interpreter."""

import os

# Triton reads this when a kernel is first decorated; set it before anything imports them.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ipython():
    """The one IPython shell of the test session, with the workbench extension loaded
    (IPython's test shell is a process-wide singleton: start it once)."""
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "workbench")
    return ip
