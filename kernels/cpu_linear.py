"""Linear layers on CPU tensors: a few activation rows through the few-rows kernel, several
rows with a large weight through oneDNN on a packed copy of the weight, each where that pays,
everything else through torch's ``F.linear``.

Contract: ``F.linear(x, weight, bias)`` up to floating-point rounding (fp32; other dtypes and
the batch-invariant mode always take ``F.linear``).

Why: a decode step, a speculative verify chunk (k + 1 rows) and a prefill multiply a few or
many activation rows by every weight of the model. On the AMD EPYC this VM sometimes is, the
SGEMM torch calls costs 2-4x its 1-row product from 3-4 rows on (MKL keeps its fast paths for
Intel's CPUs). Two remedies, each measured once per process and thread count by a probe with
a wide margin (so that the choice does not flip on noise):

* **Few rows** (1 to :data:`~workbench.kernels.cpu_few_rows.MAX_ROWS`): the numba kernel of
  :mod:`workbench.kernels.cpu_few_rows` reads an output-major weight once for all the rows
  (:func:`few_rows_pays`). Where it pays the loader keeps the checkpoint's output-major layout
  (:mod:`workbench.model.weight_layout`); elsewhere it stores weights input-major for MKL.
* **Several rows with a large weight** (at least :data:`MIN_ROWS` rows, at least
  :data:`MIN_ELEMENTS` elements, past the few-rows kernel where that runs): oneDNN's JIT GEMM
  on a weight reordered once into its blocked layout costs little more at 5 rows than at 1,
  after a fixed ~12 us a call (:func:`onednn_pays`).

On an Intel Xeon torch's SGEMM measured faster than oneDNN at 1 and 5 rows, so either remedy
is taken only where its probe says so; ``python -m workbench.kernels.cpu_linear`` prints the
probes and the model's shapes, and ``WORKBENCH_CPU_GEMM=torch|onednn|numba`` pins the choice
(default ``auto``).

The packed copy (:class:`PackedWeight`) costs the weight's size again; it is made at the first
product that takes oneDNN and made again whenever the weight's storage or version changes (a
reload, sleep and wake-up, an in-place edit under ``torch.no_grad``). A write through
``.data`` changes neither: whoever writes weights that way calls the model's
``pack_weights()`` again (the loader does). The few-rows kernel reads the weight itself.
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F

from workbench.kernels import batch_invariant, cpu_few_rows

#: ``WORKBENCH_CPU_GEMM`` values: measure both remedies (auto), neither (torch), only oneDNN
#: (onednn), only the few-rows kernel (numba).
CHOICES = ("auto", "torch", "onednn", "numba")
#: Smallest weight (elements) worth a packed copy: below it oneDNN's fixed cost per call (~12
#: us on the EPYC) outweighs what it saves (in a step at 4-8 rows, 384x192 and 192x512 lost
#: or tied; 1024x192 and 4096x192 won by 1.3-2.7x).
MIN_ELEMENTS = 1 << 17
#: Fewest rows that take oneDNN: torch's SGEMM reads the weight once for up to 2-3 rows (2
#: rows in a step: F.linear 952 us against 1135 us for the embedded model's products).
MIN_ROWS = 3
#: oneDNN's probe: a [PROBE_OUT, PROBE_IN] input-major weight (as the loader stores them
#: without the few-rows kernel, 4 MB: beyond a core's L2, as in a forward) times PROBE_ROWS
#: rows, a speculative verify chunk.
PROBE_OUT, PROBE_IN, PROBE_ROWS = 4096, 256, 5
#: The few-rows kernel's probe: a [FEW_OUT, FEW_IN] weight (1 MB, cycled through 16 MB of
#: copies: cold, as in a forward) at each of FEW_ROWS rows (a decode, a verify chunk).
FEW_OUT, FEW_IN, FEW_ROWS = 1024, 256, (1, 5)
#: ``auto`` takes a remedy only where it is this many times faster than ``F.linear`` in its
#: probe (oneDNN: 1.9-3.2x on the EPYC; the few-rows kernel: 1.7-2.3x there over both of its
#: row counts, 1.1-1.6x at one row and 2.2-2.7x at five): a CPU near the line keeps torch's
#: path, so the choice does not flip on noise.
MARGIN = 1.5
#: The products :func:`probe` times.
PATHS = ("F.linear", "oneDNN", "few-rows")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def probe(out_features: int = PROBE_OUT, in_features: int = PROBE_IN, rows: int = PROBE_ROWS,
          rounds: int = 20, copies: int = 1, paths: tuple[str, ...] = PATHS) -> dict[str, float]:
    """Median seconds of each of ``paths`` that can run here for a random ``[out_features,
    in_features]`` weight times ``rows`` rows, ``rounds`` runs each, interleaved so that all
    see the same cache and load: ``"F.linear"`` (on the weight stored input-major),
    ``"oneDNN"`` (on its packed copy, where torch has oneDNN) and ``"few-rows"`` (on it
    output-major, where numba imports and the rows are few enough). With ``copies`` > 1 each
    run takes the next of that many copies of the weight (cold, as in a forward)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=gen) for _ in range(copies)]
    input_major = [w.t().contiguous().t() for w in weights]
    x = torch.randn(rows, in_features, generator=gen)
    runs = {"F.linear": lambda i: F.linear(x, input_major[i])}
    if "oneDNN" in paths and torch.backends.mkldnn.is_available():
        packed = [_pack(w) for w in input_major]
        runs["oneDNN"] = lambda i: _onednn(x, packed[i], None)
    if "few-rows" in paths and cpu_few_rows.available() and cpu_few_rows.eligible(x, weights[0]):
        runs["few-rows"] = lambda i: cpu_few_rows.linear(x, weights[i])
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(rounds):
        for offset, (name, run) in enumerate(runs.items()):
            start = time.perf_counter()
            run((i + offset * copies // len(runs)) % copies)
            times[name].append(time.perf_counter() - start)
    return {name: sorted(took)[rounds // 2] for name, took in times.items()}


def choice() -> str:
    """``WORKBENCH_CPU_GEMM`` (``auto`` when unset); ValueError naming the variable otherwise."""
    value = os.environ.get("WORKBENCH_CPU_GEMM", "auto")
    if value not in CHOICES:
        raise ValueError(f"WORKBENCH_CPU_GEMM must be one of {list(CHOICES)}, got {value!r}.")
    return value


def few_rows_pays() -> bool:
    """Whether products of 1 to ``cpu_few_rows.MAX_ROWS`` rows take the few-rows kernel in this
    process (where the weight is output-major); always under ``numba`` where numba imports.
    Under ``auto`` it is :func:`probe`'d once per thread count at a decode's and a verify
    chunk's rows (:data:`FEW_ROWS`): the kernel must be no slower for the decode and
    :data:`MARGIN` times faster for the two together."""
    return _decide_few_rows(choice(), torch.get_num_threads())


@functools.cache
def _decide_few_rows(value: str, num_threads: int) -> bool:
    if value not in ("auto", "numba") or not cpu_few_rows.available():
        return False
    if value == "numba":
        return True
    copies = (16 << 20) // (FEW_OUT * FEW_IN * 4)
    decode, verify = (probe(FEW_OUT, FEW_IN, rows, copies=copies, paths=("F.linear", "few-rows"))
                      for rows in FEW_ROWS)
    return (decode["few-rows"] <= decode["F.linear"]
            and (decode["few-rows"] + verify["few-rows"]) * MARGIN < decode["F.linear"] + verify["F.linear"])


def onednn_pays() -> bool:
    """Whether products of several rows with a packable weight take oneDNN in this process:
    :func:`probe`'d once per thread count under ``auto``; always under ``onednn``."""
    return _decide_onednn(choice(), torch.get_num_threads())


@functools.cache
def _decide_onednn(value: str, num_threads: int) -> bool:
    if value not in ("auto", "onednn") or not torch.backends.mkldnn.is_available():
        return False
    if value == "onednn":
        return True
    result = probe(paths=("F.linear", "oneDNN"))
    return result["oneDNN"] * MARGIN < result["F.linear"]


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
    """``F.linear(x, weight, bias)``, outside the batch-invariant mode (whose products are its
    own) through the few-rows kernel where :func:`few_rows_pays` and the kernel takes ``x`` and
    ``weight`` (output-major), else through ``packed`` when ``x`` is 2-D with at least
    :data:`MIN_ROWS` rows and :func:`onednn_pays` says so."""
    if batch_invariant.enabled():
        return F.linear(x, weight, bias)
    if cpu_few_rows.eligible(x, weight) and few_rows_pays():
        return cpu_few_rows.linear(x, weight, bias)
    if packed is None or x.dim() != 2 or x.shape[0] < MIN_ROWS or not onednn_pays():
        return F.linear(x, weight, bias)
    return _onednn(x, packed.of(weight), bias)


def describe() -> str:
    """This process's CPU linear path in a few words (benchmark headers)."""
    paths = []
    if few_rows_pays():
        paths.append(f"the few-rows kernel up to {cpu_few_rows.MAX_ROWS} rows")
    if onednn_pays():
        paths.append(f"oneDNN from {MIN_ROWS} rows on weights of >= {MIN_ELEMENTS} elements")
    return ", ".join(paths + ["else F.linear"]) if paths else "F.linear"


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` gets a :class:`PackedWeight`: fp32, 2-D, on the CPU, at least
    :data:`MIN_ELEMENTS`, and torch has oneDNN."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() >= MIN_ELEMENTS and torch.backends.mkldnn.is_available())


def main(argv: list[str] | None = None) -> None:
    """Print the probes, this process's choices, and every path's product for the embedded
    model's weight shapes (or ``--shape``), cold (the weight cycled with copies past the L2, as
    in a forward)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workbench.kernels.cpu_linear",
                                     description="F.linear, oneDNN on a packed weight and the few-rows kernel, per row count.")
    parser.add_argument("--shape", nargs="+", default=["192x192", "384x192", "192x512", "1024x192", "4096x192"],
                        help="weight shapes OUTxIN (default: the embedded model's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shape]
    print(f"torch threads: {torch.get_num_threads()}, WORKBENCH_CPU_GEMM={choice()}, numba "
          f"{'imports' if cpu_few_rows.available() else 'does not import'}; a remedy is taken from {MARGIN}x "
          f"faster than F.linear (the few-rows kernel: over its probes together)")
    for name, (out_features, in_features, rows_list, copies) in {
            "oneDNN": (PROBE_OUT, PROBE_IN, (PROBE_ROWS,), 1),
            "few-rows": (FEW_OUT, FEW_IN, FEW_ROWS, (16 << 20) // (FEW_OUT * FEW_IN * 4))}.items():
        for rows in rows_list:
            result = probe(out_features, in_features, rows, copies=copies, paths=("F.linear", name))
            if name in result:
                print(f"probe {out_features}x{in_features} at {rows} rows: F.linear {result['F.linear'] * 1e6:.1f} us, "
                      f"{name} {result[name] * 1e6:.1f} us ({result['F.linear'] / result[name]:.2f}x)")
    print(f"this process: {describe()}")
    print(f"{'weight':>10} {'rows':>5} {'F.linear us':>12} {'oneDNN us':>10} {'few-rows us':>12}")
    for out_features, in_features in shapes:
        copies = max(1, min(64, (16 << 20) // (out_features * in_features * 4)))  # 16 MB of them
        for rows in (1, 2, 3, 4, 5, 8, 16, 64):
            result = probe(out_features, in_features, rows, rounds=30, copies=copies)
            cells = [f"{result[name] * 1e6:>{width}.1f}" if name in result else f"{'-':>{width}}"
                     for name, width in (("F.linear", 12), ("oneDNN", 10), ("few-rows", 12))]
            print(f"{out_features:>5}x{in_features:<4} {rows:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()
