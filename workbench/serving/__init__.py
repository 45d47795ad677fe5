"""OpenAI-compatible serving: :class:`AsyncLLM` (the engine in a background thread) and a
FastAPI app (``build_app``) with vLLM's endpoints. ``workbench serve`` runs it with uvicorn."""

from workbench.serving.async_llm import AsyncLLM, EngineDeadError, RequestStream

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream", "build_app"]


def __getattr__(name: str):
    if name == "build_app":  # FastAPI is imported only when the app is wanted
        from workbench.serving.api_server import build_app

        return build_app
    raise AttributeError(f"module 'workbench.serving' has no attribute {name!r}")
