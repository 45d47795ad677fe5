"""LLM's pooling methods (vLLM's ``LLM.encode`` / ``embed`` / ``score``), for an engine built
with ``runner="pooling", convert="embed"``. Mixed into :class:`~workbench.entrypoints.llm.LLM`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.nn.functional as F

from workbench.engine.input_processor import PromptType
from workbench.pooling.outputs import (EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput,
                                       ScoringRequestOutput)
from workbench.pooling_params import PoolingParams
from workbench.utils.heap import frozen_heap


def validate_score_input_lens(num_1: int, num_2: int) -> None:
    """vLLM's rule for score pairs: 1:1, 1:N or N:N, neither side empty."""
    if num_1 > 1 and num_1 != num_2:
        raise ValueError("Input lengths must be either 1:1, 1:N or N:N")
    if num_1 == 0:
        raise ValueError("At least one text element must be given")
    if num_2 == 0:
        raise ValueError("At least one text_pair element should be given")


def cosine_scores(embeds_1: list[PoolingRequestOutput], embeds_2: list[PoolingRequestOutput]
                  ) -> list[ScoringRequestOutput]:
    """One score per pair: the cosine similarity of the two embeddings (a single first
    embedding is paired with every second one)."""
    if len(embeds_1) == 1:
        embeds_1 = embeds_1 * len(embeds_2)
    return [ScoringRequestOutput(
        f"{a.request_id}_{b.request_id}",
        ScoringOutput(F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0).item()),
        a.prompt_token_ids + b.prompt_token_ids, a.num_cached_tokens + b.num_cached_tokens)
        for a, b in zip(embeds_1, embeds_2)]


class PoolingMixin:
    """``encode`` / ``embed`` / ``score`` over ``self.engine`` (outputs in input order)."""

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None, lora_request=None,
               tokenization_kwargs: Mapping | None = None) -> list[PoolingRequestOutput]:
        """Pool every prompt for ``pooling_task`` ("embed": one vector per prompt;
        "token_embed": one per token), which must be named, as vLLM asks."""
        tasks = self.engine.supported_tasks
        if pooling_task is None:
            raise ValueError("pooling_task is required for `LLM.encode`: use `LLM.embed(...)` or "
                             f"pooling_task='embed', or pooling_task='token_embed' for one vector "
                             f"per token (this model supports {list(tasks)}).")
        if pooling_task not in tasks:
            raise ValueError(f"pooling_task must be one of {list(tasks)}, got {pooling_task!r}.")
        if isinstance(prompts, (str, Mapping)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        pooling_params = list(pooling_params)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"pooling_params has {len(pooling_params)} entries but there are "
                             f"{len(prompts)} prompts.")
        engine, requests = self.engine, []
        for i, (prompt, params) in enumerate(zip(prompts, pooling_params)):
            params = params.clone()
            if truncate_prompt_tokens is not None:
                params.truncate_prompt_tokens = truncate_prompt_tokens
            try:  # every prompt processed (once) before any is added
                requests.append(engine.pooling.process_inputs(
                    engine.input_processor, f"pool-{self._num_added + i}", prompt,
                    engine.pooling.verify(params, pooling_task), lora_request=lora_request,
                    tokenization_kwargs=tokenization_kwargs))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from exc
        return self._run_pooling(requests, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request=None, tokenization_kwargs: Mapping | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``: a list of floats)."""
        if "embed" not in self.engine.supported_tasks:
            raise ValueError("Embedding API is not supported by this model. Try converting the "
                             "model using `--convert embed`.")
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, pooling_task="embed", lora_request=lora_request,
                           tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: PromptType | Sequence[PromptType],
              data_2: PromptType | Sequence[PromptType], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request=None
              ) -> list[ScoringRequestOutput]:
        """vLLM's score for an embedding model: the cosine similarity of each pair's
        embeddings (pairs 1:1, 1:N or N:N)."""
        if "embed" not in self.engine.supported_tasks:
            raise ValueError("Score API is not supported by this model. Try converting the model "
                             "using `--convert embed`.")
        data_1 = [data_1] if isinstance(data_1, (str, Mapping)) else list(data_1)
        data_2 = [data_2] if isinstance(data_2, (str, Mapping)) else list(data_2)
        validate_score_input_lens(len(data_1), len(data_2))
        outs = self.encode(data_1 + data_2, pooling_params,
                           truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           pooling_task="embed", lora_request=lora_request)
        return cosine_scores(outs[:len(data_1)], outs[len(data_1):])

    def _run_pooling(self, requests, use_tqdm: bool) -> list[PoolingRequestOutput]:
        from tqdm.auto import tqdm

        engine, ids = self.engine, []
        try:
            for request in requests:
                self._num_added += 1
                engine.add_request(request.request_id, request)
                ids.append(request.request_id)
        except ValueError:
            engine.abort_request(ids)
            raise
        wanted, results = set(ids), {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar, frozen_heap():
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        if getattr(out, "error", None) is not None:
                            raise RuntimeError(f"request {out.request_id!r} failed: {out.error}")
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]
