"""Input-major weights on CPU: every 2-D fp32 weight stored with its transpose contiguous.

``F.linear(x, W)`` multiplies the ``[tokens, in]`` activations by ``W.T`` with ``W`` stored
``[out, in]``. MKL's SGEMM on that transposed operand reads ``W`` once per ~3 activation
rows: a 5-token speculative verify chunk costs twice a 1-token decode in every projection and
in the LM head, and a 1-row product on the small layers costs ~1.5-2x what it does with
``W.T`` contiguous, which reads ``W`` once for up to ~8 rows and was not slower at any row
count measured (1 to 1024 rows, the embedded model's shapes). Shapes, values and every reader
stay the same: the checkpoint's row ranges are copied in before, exports are views, and
``F.embedding`` gathers rows of any layout.
"""

from __future__ import annotations

import torch
from torch import nn


def store_input_major(model: nn.Module) -> None:
    """Re-store each 2-D fp32 CPU parameter of ``model`` (a tied one once) input-major:
    ``p.data = p.data.t().contiguous().t()``, the same tensor values under the same shape."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and p.device.type == "cpu" and p.dtype == torch.float32:
                p.data = p.data.t().contiguous().t()
