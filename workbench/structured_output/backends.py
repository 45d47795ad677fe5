"""Which backend compiles a constraint, chosen as vLLM's input processor chooses, and the
constraint's :class:`~workbench.structured_output.request.GrammarKey`.

The backend (:func:`select_backend`): the engine's configured one, whose parser must accept
the constraint; with "auto", xgrammar, else (unless ``disable_fallback``) guidance, vLLM's
fallback; a ``whitespace_pattern`` needs guidance, the one backend that honours it. Both
parse without the tokenizer (cheap), so the check runs before a request reaches the engine.
"""

from __future__ import annotations

import functools

from workbench.config import StructuredOutputsConfig
from workbench.sampling_params import StructuredOutputsParams
from workbench.structured_output import backend_guidance, backend_xgrammar
from workbench.structured_output.request import GrammarKey, constraint_spec


def grammar_key(params: StructuredOutputsParams,
                config: StructuredOutputsConfig | None = None) -> GrammarKey:
    """The cache key of a constraint under ``config`` (default: vLLM's defaults), its
    backend chosen by :func:`select_backend` (ValueError when no backend accepts it)."""
    config = config or StructuredOutputsConfig()
    kind, spec = constraint_spec(params)
    key = GrammarKey(
        "", kind, spec,
        any_whitespace=not (params.disable_any_whitespace or config.disable_any_whitespace),
        whitespace_pattern=params.whitespace_pattern if kind in ("json", "json_object") else None,
        disable_additional_properties=(params.disable_additional_properties
                                       or config.disable_additional_properties))
    fallback = not (params.disable_fallback or config.disable_fallback)
    return key._replace(backend=select_backend(key, config.backend, fallback))


@functools.lru_cache(maxsize=4096)
def select_backend(key: GrammarKey, backend: str, fallback: bool = True) -> str:
    """The backend that compiles ``key`` (its own ``backend`` field ignored) when the engine's
    is ``backend``; ValueError with the parser's message when it refuses the constraint."""
    if backend == "guidance" or (backend == "auto" and key.whitespace_pattern is not None):
        backend_guidance.validate(key)
        return "guidance"
    if key.whitespace_pattern is not None:
        raise ValueError("whitespace_pattern is only supported by the guidance backend "
                         "(this engine's is xgrammar; use disable_any_whitespace).")
    try:
        backend_xgrammar.validate(key)
        return "xgrammar"
    except ValueError as exc:
        if backend == "xgrammar" or not fallback:
            raise
        refused = exc
    try:
        backend_guidance.validate(key)
    except ValueError:
        raise refused from None  # xgrammar's message: the primary backend's
    return "guidance"
