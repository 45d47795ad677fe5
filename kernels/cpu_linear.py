"""Linear layers on CPU tensors: a product of several activation rows with a large weight
through oneDNN on a packed copy of the weight where that pays, everything else through
torch's ``F.linear``.

Contract: ``F.linear(x, weight, bias)`` up to floating-point rounding (fp32; other dtypes and
the batch-invariant mode always take ``F.linear``).

Why: a speculative verify chunk (k + 1 rows), a small decode batch and a prefill multiply a
few activation rows by every weight of the model. On the AMD EPYC this VM sometimes is, the
SGEMM torch calls costs 2-4x its 1-row product from 3-4 rows on (MKL keeps its fast paths
for Intel's CPUs), while oneDNN's JIT GEMM on a weight reordered once into its blocked layout
costs little more at 5 rows than at 1, after a fixed ~12 us a call. So oneDNN takes products
of at least :data:`MIN_ROWS` rows with weights of at least :data:`MIN_ELEMENTS` elements.
On an Intel Xeon torch's SGEMM measured faster than oneDNN at 1 and 5 rows, so whether
oneDNN is used at all is measured once per process and thread count (:func:`onednn_pays`,
with a wide margin so that it does not flip on noise); ``python -m
workbench.kernels.cpu_linear`` prints the probe and the model's shapes, and
``WORKBENCH_CPU_GEMM=torch|onednn`` pins the choice (default ``auto``).

The packed copy (:class:`PackedWeight`) costs the weight's size again; it is made at the first
product that takes oneDNN and made again whenever the weight's storage or version changes (a
reload, sleep and wake-up, an in-place edit under ``torch.no_grad``). A write through
``.data`` changes neither: whoever writes weights that way calls the model's
``pack_weights()`` again (the loader does).
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F

from workbench.kernels import batch_invariant

#: ``WORKBENCH_CPU_GEMM`` values: measure (auto), never oneDNN (torch), oneDNN (onednn).
CHOICES = ("auto", "torch", "onednn")
#: Smallest weight (elements) worth a packed copy: below it oneDNN's fixed cost per call (~12
#: us on the EPYC) outweighs what it saves (in a step at 4-8 rows, 384x192 and 192x512 lost
#: or tied; 1024x192 and 4096x192 won by 1.3-2.7x).
MIN_ELEMENTS = 1 << 17
#: Fewest rows that take oneDNN: torch's SGEMM reads the weight once for up to 2-3 rows (2
#: rows in a step: F.linear 952 us against 1135 us for the embedded model's products).
MIN_ROWS = 3
#: The probe: a [PROBE_OUT, PROBE_IN] input-major weight (as the loader stores them, 4 MB:
#: beyond a core's L2, as in a forward) times PROBE_ROWS rows, a speculative verify chunk.
PROBE_OUT, PROBE_IN, PROBE_ROWS = 4096, 256, 5
#: ``auto`` takes oneDNN only where it is this many times faster in the probe (1.9-3.2x on
#: the EPYC): a CPU near the line keeps torch's path, so the choice does not flip on noise.
MARGIN = 1.5


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def probe(out_features: int = PROBE_OUT, in_features: int = PROBE_IN, rows: int = PROBE_ROWS,
          rounds: int = 20, copies: int = 1) -> tuple[float, float]:
    """Median seconds of ``F.linear`` and of the packed oneDNN product for a random
    input-major ``[out_features, in_features]`` weight times ``rows`` rows, ``rounds`` runs
    each, interleaved so that both see the same cache and load; with ``copies`` > 1 each run
    takes the next of that many copies of the weight (cold, as in a forward)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=gen).t().contiguous().t()
               for _ in range(copies)]
    packed = [_pack(w) for w in weights]
    x = torch.randn(rows, in_features, generator=gen)
    times: list[list[float]] = [[], []]
    for i in range(rounds):
        runs = (lambda: F.linear(x, weights[i % copies]),
                lambda: _onednn(x, packed[(i + copies // 2) % copies], None))
        for took, run in zip(times, runs):
            start = time.perf_counter()
            run()
            took.append(time.perf_counter() - start)
    return sorted(times[0])[rounds // 2], sorted(times[1])[rounds // 2]


def choice() -> str:
    """``WORKBENCH_CPU_GEMM`` (``auto`` when unset); ValueError naming the variable otherwise."""
    value = os.environ.get("WORKBENCH_CPU_GEMM", "auto")
    if value not in CHOICES:
        raise ValueError(f"WORKBENCH_CPU_GEMM must be one of {list(CHOICES)}, got {value!r}.")
    return value


def onednn_pays() -> bool:
    """Whether products of several rows with a packable weight take oneDNN in this process:
    :func:`probe`'d once per thread count under ``auto``."""
    return _decide(choice(), torch.get_num_threads())


@functools.cache
def _decide(value: str, num_threads: int) -> bool:
    if value != "auto" or not torch.backends.mkldnn.is_available():
        return value == "onednn"
    torch_s, onednn_s = probe()
    return onednn_s * MARGIN < torch_s


class PackedWeight:
    """oneDNN's blocked copy of one fp32 CPU weight, kept in step with the weight: remade when
    the weight's ``data_ptr`` or ``_version`` differs from the copy's."""

    __slots__ = ("_key", "_packed")

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            self._packed, self._key = _pack(weight), key
        return self._packed

    def __deepcopy__(self, memo) -> PackedWeight:
        """An engine fork's own cache over the same packed tensor, as forks share the weights
        (``workbench.engine.fork``): the tensor is never written (a repack makes a new one),
        and releasing or repacking one cache leaves the other as it was. (oneDNN's opaque
        tensor cannot be deep-copied.)"""
        twin = PackedWeight()
        twin._key, twin._packed = self._key, self._packed
        return twin

    def release(self) -> None:
        """Free the copy (sleep mode); the next product that takes oneDNN packs again."""
        self._key = self._packed = None

    @property
    def nbytes(self) -> int:
        """Bytes the packed copy holds now (0 until a product takes oneDNN)."""
        return 0 if self._packed is None else self._packed.numel() * self._packed.element_size()

    def __repr__(self) -> str:
        return f"PackedWeight({'packed' if self._packed is not None else 'not packed'})"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through ``packed`` when ``x`` is 2-D with at least
    :data:`MIN_ROWS` rows, :func:`onednn_pays` says so, and the batch-invariant mode (whose
    products are its own) is off."""
    if (packed is None or x.dim() != 2 or x.shape[0] < MIN_ROWS or batch_invariant.enabled()
            or not onednn_pays()):
        return F.linear(x, weight, bias)
    return _onednn(x, packed.of(weight), bias)


def describe() -> str:
    """This process's CPU linear path in a few words (benchmark headers)."""
    if not onednn_pays():
        return "F.linear"
    return f"oneDNN from {MIN_ROWS} rows on weights of >= {MIN_ELEMENTS} elements, else F.linear"


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` gets a :class:`PackedWeight`: fp32, 2-D, on the CPU, at least
    :data:`MIN_ELEMENTS`, and torch has oneDNN."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() >= MIN_ELEMENTS and torch.backends.mkldnn.is_available())


def main(argv: list[str] | None = None) -> None:
    """Print the probe's two products for the embedded model's weight shapes (or ``--shape``),
    cold (the weight cycled with copies past the L2, as in a forward), and this process's choice."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workbench.kernels.cpu_linear",
                                     description="F.linear against oneDNN on a packed weight, per row count.")
    parser.add_argument("--shape", nargs="+", default=["192x192", "384x192", "192x512", "1024x192", "4096x192"],
                        help="weight shapes OUTxIN (default: the embedded model's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shape]
    torch_s, onednn_s = probe()
    print(f"torch threads: {torch.get_num_threads()}, WORKBENCH_CPU_GEMM={choice()}; probe "
          f"({PROBE_OUT}x{PROBE_IN}, {PROBE_ROWS} rows): F.linear {torch_s * 1e6:.1f} us, oneDNN "
          f"{onednn_s * 1e6:.1f} us ({torch_s / onednn_s:.2f}x; oneDNN is taken from {MARGIN}x): "
          f"several rows take {'oneDNN' if onednn_pays() else 'F.linear'} on weights of >= {MIN_ELEMENTS} elements")
    print(f"{'weight':>10} {'rows':>5} {'F.linear us':>12} {'oneDNN us':>10} {'ratio':>6}")
    for out_features, in_features in shapes:
        copies = max(1, min(64, (16 << 20) // (out_features * in_features * 4)))  # 16 MB of them
        for rows in (1, 2, 3, 4, 5, 8, 16, 64):
            torch_s, onednn_s = probe(out_features, in_features, rows, rounds=30, copies=copies)
            print(f"{out_features:>5}x{in_features:<4} {rows:>5} {torch_s * 1e6:>12.1f} {onednn_s * 1e6:>10.1f}"
                  f" {torch_s / onednn_s:>6.2f}")


if __name__ == "__main__":
    main()
