"""Beam search driven above the engine, as vLLM drives it (``LLM.beam_search``, ``use_beam_search``).

The engine knows nothing of beams. Each step of a search adds one ordinary request per live
beam: its prompt is the beam's tokens, ``max_tokens=1``, ``logprobs=2 * beam_width``. Every
(beam, one of its returned tokens) pair is a candidate scored by its cumulative logprob; the
best ``beam_width`` candidates that do not end in EOS live on, and one that ends in EOS
(unless ``ignore_eos``) is set aside as finished. After ``max_tokens`` steps, or once no
beam is left, the finished and live beams are ranked by :func:`get_beam_search_score` and
the best ``beam_width`` returned, best first.

Invariants: a live beam holds ``len(prompt) + steps`` tokens; ``cum_logprob`` is the sum of
the raw logprobs of its generated tokens. Because the beams of one search share their
prefix, each step's requests hit the blocks earlier steps computed in the prefix cache: the
full blocks of a prefix several beams share are held by all of their requests at once
(``ref_count`` > 1 while the step runs: ``StepHistory.kv_state(step, during_forward=True)``).
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workbench.outputs import CompletionOutput, Logprob, RequestOutput
from workbench.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` include the prompt (and the EOS that finished it, if one did);
    ``logprobs`` has one dict per generated token (the step's candidates); ``text`` is set
    when the beam is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def __repr__(self) -> str:
        return (f"BeamSearchSequence(tokens={self.tokens}, cum_logprob={round(self.cum_logprob, 4)}, "
                f"text={self.text!r}, finish_reason={self.finish_reason!r})")


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt (at most ``beam_width``), best first."""

    sequences: list[BeamSearchSequence]

    def __repr__(self) -> str:
        return "BeamSearchOutput(sequences=[" + ", ".join(map(repr, self.sequences)) + "])"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{i}</td><td style='text-align:left;white-space:pre-wrap'>"
            f"{html.escape(s.text or '')}</td><td>{s.cum_logprob:.4f}</td>"
            f"<td>{html.escape(str(s.finish_reason))}</td></tr>"
            for i, s in enumerate(self.sequences)
        )
        return ("<table><caption style='text-align:left'>BeamSearchOutput</caption>"
                "<tr><th>#</th><th>text</th><th>cum_logprob</th><th>finish</th></tr>" + rows + "</table>")


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score of a beam: ``cumulative_logprob / seq_len ** length_penalty``, where
    ``seq_len`` counts every token (the prompt included) but a final EOS."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


def check_beam_width(beam_width: int, max_logprobs: int, field: str = "beam_width") -> None:
    """Each step asks for ``2 * beam_width`` logprobs: ValueError naming ``field`` when the
    engine's ``max_logprobs`` allows fewer."""
    if 2 * beam_width > max_logprobs:
        raise ValueError(f"{field}: beam search with a width of {beam_width} asks for "
                         f"2 * {beam_width} = {2 * beam_width} logprobs per step, more than "
                         f"max_logprobs={max_logprobs}.")


class BeamSearchInstance:
    """The state of one prompt's search: the live ``beams`` (one request each per step) and
    the ``completed`` ones. :meth:`advance` takes the step's outputs, one per live beam."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_id: int | None, *, cache_salt: str | None = None) -> None:
        self.params = params
        self.cache_salt = cache_salt
        self.eos_token_id = eos_token_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.num_steps >= self.params.max_tokens

    def step_params(self) -> SamplingParams:
        """The SamplingParams of every beam's request in a step."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.params.beam_width,
                              temperature=self.params.temperature, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def prompts(self) -> list[dict]:
        """The step's prompts, one per live beam (its tokens; the search's cache_salt)."""
        salt = {} if self.cache_salt is None else {"cache_salt": self.cache_salt}
        return [{"prompt_token_ids": list(beam.tokens), **salt} for beam in self.beams]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Expand every beam by its request's returned tokens and keep the best.
        ``outputs[i]`` is the finished output of ``beams[i]``'s request."""
        if len(outputs) != len(self.beams):
            raise ValueError(f"advance: {len(outputs)} outputs for {len(self.beams)} beams.")
        candidates: list[tuple[float, int, BeamSearchSequence, dict]] = []
        for beam, out in zip(self.beams, outputs):
            completion = out.outputs[0]
            if completion.finish_reason == "error":
                raise RuntimeError(f"beam search: the request {out.request_id} failed: {out.error}")
            if not completion.logprobs:  # nothing came back (aborted): this beam ends here
                continue
            step_logprobs = completion.logprobs[0]
            for token_id, logprob in step_logprobs.items():
                cum = beam.cum_logprob + logprob.logprob
                if token_id == self.eos_token_id and not self.params.ignore_eos:
                    self.completed.append(BeamSearchSequence(
                        tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [step_logprobs],
                        cum_logprob=cum, finish_reason="stop", stop_reason=token_id))
                else:
                    candidates.append((cum, token_id, beam, step_logprobs))
        candidates.sort(key=lambda c: c[0], reverse=True)  # stable: ties keep beam, then rank order
        self.beams = [
            BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [lps],
                               cum_logprob=cum)
            for cum, token_id, beam, lps in candidates[: self.params.beam_width]
        ]
        self.num_steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` of the finished and live beams by score, best first; the
        live ones are marked ``finish_reason="length"``."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        p = self.params
        ranked = sorted(self.completed + self.beams, reverse=True,
                        key=lambda b: get_beam_search_score(b.tokens, b.cum_logprob,
                                                            self.eos_token_id, p.length_penalty))
        return ranked[: p.beam_width]

    def request_output(self, request_id: str, prompt: str | None,
                       best: Sequence[BeamSearchSequence], texts: Sequence[str]) -> RequestOutput:
        """The server's RequestOutput of this search (vLLM's shape): one CompletionOutput per
        beam in ``best`` order, its ``text`` given (see :meth:`text_tokens`), its generated
        tokens (a final EOS only with ``include_stop_str_in_output``) and cumulative logprob."""
        outputs = []
        for i, (beam, text) in enumerate(zip(best, texts)):
            tokens = beam.tokens[self.prompt_len:]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                tokens = tokens[:-1]
            beam.text = text
            outputs.append(CompletionOutput(
                index=i, text=text, token_ids=tokens, cumulative_logprob=beam.cum_logprob,
                logprobs=None, finish_reason=beam.finish_reason, stop_reason=beam.stop_reason))
        return RequestOutput(request_id=request_id, prompt=prompt,
                             prompt_token_ids=list(self.prompt_token_ids), outputs=outputs, finished=True)

    def text_tokens(self, beam: BeamSearchSequence) -> list[int]:
        """The generated tokens the server's text shows: a final EOS never."""
        tokens = beam.tokens[self.prompt_len:]
        return tokens[:-1] if beam.finish_reason == "stop" else tokens


def beam_search(generate: Callable[[list[dict], SamplingParams], list[RequestOutput]],
                prompts_token_ids: Sequence[Sequence[int]], params: BeamSearchParams,
                eos_token_id: int | None, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
    """Search every prompt at once: per step, one ``generate(prompts, sampling_params)`` call
    runs every live beam of every prompt (one batch); outputs in prompt order. As vLLM's
    ``LLM.beam_search``, a sequence's ``text`` is the decoded ``tokens``, prompt included."""
    instances = [BeamSearchInstance(ids, params, eos_token_id) for ids in prompts_token_ids]
    sampling_params = instances[0].step_params() if instances else None
    while True:
        live = [inst for inst in instances if not inst.done]
        if not live:
            break
        prompts = [p for inst in live for p in inst.prompts()]
        outputs = generate(prompts, sampling_params)
        start = 0
        for inst in live:
            n = len(inst.beams)
            inst.advance(outputs[start:start + n])
            start += n
    results = []
    for inst in instances:
        best = inst.best()
        for beam in best:
            beam.text = decode(beam.tokens)
        results.append(BeamSearchOutput(sequences=best))
    return results


async def beam_search_async(engine_client, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                            request_id: str, eos_token_id: int | None, *, cache_salt: str | None = None
                            ) -> tuple[BeamSearchInstance, list[BeamSearchSequence]]:
    """One prompt's search through an :class:`~workbench.engine.async_llm.AsyncLLM` (the
    server's path): per step, one request per live beam, ``{request_id}-{step}-beam-{i}``
    (with the caller's ``cache_salt``), awaited together. Returns the instance and its best
    beams (``text`` not yet set). Cancelling it cancels the step's requests: they are aborted."""
    inst = BeamSearchInstance(prompt_token_ids, params, eos_token_id, cache_salt=cache_salt)
    sampling_params = inst.step_params()

    async def last(prompt: dict, rid: str) -> RequestOutput:
        out = None
        async for out in engine_client.generate(prompt, sampling_params, rid):
            pass
        return out

    while not inst.done:
        outputs = await asyncio.gather(*(
            last(prompt, f"{request_id}-{inst.num_steps}-beam-{i}") for i, prompt in enumerate(inst.prompts())
        ))
        inst.advance(outputs)
    return inst, inst.best()
