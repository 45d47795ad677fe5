"""GET /v1/models (the base model, then each LoRA adapter with its ``parent``), POST /tokenize (a text or a chat) and POST /detokenize, vLLM's shapes.

Tokenizer work runs on AsyncLLM's input thread, never on the engine thread.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from workbench.entrypoints.openai import protocol as P
from workbench.entrypoints.openai import responses as R
from workbench.entrypoints.openai.chat import render
from workbench.entrypoints.openai.errors import APIError
from workbench.entrypoints.openai.serving import OpenAIServing


def tokenization_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def show_available_models() -> Response:
        cards = [R.ModelCard(id=serving.model_name, root=serving.model_name,
                             max_model_len=serving.max_model_len)]
        cards += [R.ModelCard(id=lora.lora_name, root=lora.lora_path,
                              parent=lora.base_model_name or serving.model_name)
                  for lora in serving.lora_requests.values()]
        return JSONResponse(R.dump(R.ModelList(data=cards)))

    @router.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest) -> Response:
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of 'prompt' and 'messages'.", "prompt")
        if req.messages is not None:
            text = await render(
                serving, req.messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs={**({"tools": [t.model_dump(exclude_none=True)
                                                    for t in req.tools]} if req.tools else {}),
                                      **(req.chat_template_kwargs or {})},
            )
            special = False
        else:
            text, special = req.prompt, req.add_special_tokens
        ids = await serving.llm.encode(text, add_special_tokens=special)
        return JSONResponse({"count": len(ids), "max_model_len": serving.max_model_len,
                             "tokens": ids})

    @router.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest) -> Response:
        serving.check_model(req.model)
        vocab = serving.llm.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be integers in [0, {vocab}), got {bad[0]}.",
                           "tokens")
        return JSONResponse({"prompt": await serving.llm.decode(list(req.tokens))})

    return router
