"""CPU weights stored in the layout their products read best (``kernels/cpu_linear.py``).

``F.linear(x, W)`` multiplies the ``[tokens, in]`` activations by ``W.T`` with ``W`` stored
``[out, in]``. Two layouts of the same values:

* **Output-major** (``W`` contiguous, the checkpoint's): what the few-rows kernel
  (``kernels/cpu_few_rows.py``) streams, one output's weights after another. Kept wherever
  that kernel pays (``cpu_linear.few_rows_pays``); oneDNN and torch's GEMM take it as well for
  many rows (measured within noise of input-major at 16-1024 rows on the EPYC).
* **Input-major** (``W.T`` contiguous), everywhere else: MKL's SGEMM on the transposed
  operand reads ``W`` once per ~3 activation rows, so that a 5-token speculative verify chunk
  cost twice a 1-token decode in every projection and a 1-row product on the small layers
  ~1.5-2x what it does with ``W.T`` contiguous, which reads ``W`` once for up to ~8 rows and
  was not slower at any row count measured (1 to 1024 rows, the embedded model's shapes).

Shapes, values and every reader stay the same either way: the checkpoint's row ranges are
copied in before, exports are views, and ``F.embedding`` gathers rows of any layout.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.kernels import cpu_linear


def store_for_cpu_products(model: nn.Module) -> None:
    """Re-store each 2-D fp32 CPU parameter of ``model`` (a tied one once) output-major where
    the few-rows kernel pays, else input-major (``p.data = p.data.t().contiguous().t()``): the
    same tensor values under the same shape."""
    matrices = [p for p in model.parameters()
                if p.dim() == 2 and p.device.type == "cpu" and p.dtype == torch.float32]
    output_major = bool(matrices) and cpu_linear.few_rows_pays()  # (the probe: CPU models only)
    with torch.no_grad():
        for p in matrices:
            p.data = p.data.contiguous() if output_major else p.data.t().contiguous().t()
