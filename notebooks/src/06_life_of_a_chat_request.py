# %% [markdown]
# # The life of a chat request
#
# A chat request to an OpenAI-compatible server travels a long way: HTTP and JSON validation,
# the chat template, tokenization, the scheduler's queue, many engine steps, incremental
# detokenization, and back out as server-sent events. This tutorial serves the notebook's own
# engine over HTTP and follows requests through it. You will see:
#
# - `%llm serve`: the engine you can step by hand, served by an OpenAI-compatible server;
# - the official `openai` client sending chat requests, plain and streamed;
# - the raw server-sent events (SSE) of one streamed request, chunk by chunk;
# - the dashboard watching the server's engine, what the engine recorded while serving, and
#   the Prometheus `/metrics` it exports under vLLM's names;
# - a client that hangs up mid-stream, and the abort that frees its KV blocks;
# - an invalid request answered with an OpenAI-shaped 400, and the server carrying on.
#
# Everything is greedy (`temperature=0`), so the texts below are the same on every run.

# %%
import json
import socket
import time

import httpx
from openai import OpenAI, BadRequestError

%load_ext workbench

# %% [markdown]
# ## Serving the notebook's engine
#
# `%llm load` builds an engine and binds it in the notebook as `engine` (its options are
# `EngineConfig` fields; `--no-teaching` starts from the defaults rather than the tiny
# teaching engine, whose 24 blocks would be too few for the long request below).
# `%llm serve` starts a FastAPI server over that engine in a background thread. From then
# on the server's engine thread owns the engine: we only *read* it from the notebook. We pick
# a free port ourselves so that the notebook never collides with another server; the port
# differs from run to run, so the serving cell's output is not checked.

# %%
%llm load --no-teaching --block-size 8 --num-kv-blocks 128
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
engine

# %%
# NBVAL_IGNORE_OUTPUT
base_url = %llm serve --port {port}

# %% [markdown]
# ## The official client
#
# The `openai` package only needs the server's base URL. `/v1/models` names the one model the
# server holds, and a chat request comes back as one JSON body, with token counts in `usage`.
# Each request carries our own id in the `X-Request-Id` header (vLLM's convention): the
# engine then knows it as `chatcmpl-<our id>`, and the outputs below do not change from run
# to run.

# %%
client = OpenAI(base_url=base_url, api_key="not-needed")
model = client.models.list().data[0].id
print("model:", model)

question = [{"role": "user", "content": "Good morrow, sweet Juliet. What news?"}]


def ids(name):
    return {"extra_headers": {"X-Request-Id": name}}


reply = client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0,
                                       **ids("first"))
print(reply.id, repr(reply.choices[0].message.content))
print(reply.choices[0].finish_reason, reply.usage.prompt_tokens, "prompt +",
      reply.usage.completion_tokens, "completion tokens")

# %% [markdown]
# The prompt holds more tokens than the question: the server renders the message list
# through the model's chat template first. `/tokenize` shows the exact text and tokens the
# engine received:

# %%
rendered = httpx.post(base_url.removesuffix("/v1") + "/tokenize",
                      json={"model": model, "messages": question}).json()
print(rendered["count"], "tokens:", repr(engine.tokenizer.decode(rendered["tokens"])))

# %% [markdown]
# ## Streaming
#
# With `stream=True` the server sends one chunk per step that produced new text, as soon as
# the engine produced it: the first chunk carries only the assistant's role, the last one
# the finish reason, and `stream_options={"include_usage": True}` adds a final chunk with
# the token counts and no choices.

# %%
stream = client.chat.completions.create(
    model=model, messages=question, max_tokens=12, temperature=0, stream=True,
    stream_options={"include_usage": True}, **ids("streamed"),
)
for chunk in stream:
    if chunk.choices:
        choice = chunk.choices[0]
        print(f"delta={choice.delta.content!r:14} role={choice.delta.role} finish={choice.finish_reason}")
    else:
        print("usage:", chunk.usage.prompt_tokens, "prompt +", chunk.usage.completion_tokens, "completion tokens")

# %% [markdown]
# The same stream without the client: a plain HTTP POST whose response is
# `text/event-stream`, one `data: {json}` event per chunk and `data: [DONE]` at the end.
# Each chunk carries the request's id and a creation time, which changes from run to run; we
# mask the time.

# %%
def masked(line: str) -> str:
    if not line.startswith("data: {"):
        return line
    event = json.loads(line.removeprefix("data: "))
    event["created"] = "<time>"
    return "data: " + json.dumps(event)


body = {"model": model, "messages": question, "max_tokens": 4, "temperature": 0, "stream": True}
with httpx.stream("POST", base_url + "/chat/completions", json=body,
                  headers={"X-Request-Id": "raw"}) as response:
    print(response.status_code, response.headers["content-type"])
    for line in response.iter_lines():
        if line:
            print(masked(line))

# %% [markdown]
# ## What the engine saw
#
# The server drove the same `LLMEngine` you would step by hand, and it kept a `StepRecord`
# per step. The requests came one after another, so each step ran one request: a prefill
# (`P`, its prompt) then one decode per generated token (`D1`). The last request asked the
# same question as the ones before it, so most of its prompt was found in the prefix cache
# and only the tokens after the last full block were computed. Every block went back to
# the pool when its request finished.

# %%
for record in engine.history[-4:]:
    print(record)
print("free blocks:", engine.kv_cache.num_free_blocks, "of", engine.kv_cache.num_blocks)

# %% [markdown]
# One row per request, with its latencies counted in engine steps (`requests_dataframe()`
# also has them in seconds, which change from run to run):

# %%
engine.requests_dataframe().set_index("request_id")[
    ["num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "ttft_steps", "e2e_steps", "finish_reason"]
]

# %% [markdown]
# `%llm dashboard` shows the server's engine live while it serves (read-only: the server's
# engine thread drives it). Run the next cell in JupyterLab, then send requests from
# another notebook or `curl`, and watch the queues, the batch and the blocks move.

# %%
%llm dashboard

# %% [markdown]
# ## Metrics
#
# `/metrics` is Prometheus' text format, with vLLM's metric names (`vllm:...`), so a
# dashboard or alert written for vLLM works unchanged: counters of requests and tokens,
# gauges of the queues and the KV cache, histograms of latencies. The latencies vary from
# run to run, so we print only the counters and the number of latency observations.

# %%
def metric_lines(*names):
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    return [line for line in text.splitlines()
            if not line.startswith("#") and any(line.startswith(name) for name in names)]


for line in metric_lines("vllm:request_success_total", "vllm:prompt_tokens_total",
                         "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                         "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
    print(line)

# %% [markdown]
# ## A client that hangs up
#
# A streamed request may be abandoned: the user closes the tab, the client times out. The
# server notices the closed connection the next time it sends a chunk, aborts the request,
# and the engine frees its blocks at once instead of generating tokens nobody reads. Here we
# ask for 600 tokens (`ignore_eos` keeps the model from stopping early), read three
# chunks and close the connection.

# %%
long_request = dict(model=model, messages=question, max_tokens=600, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}, **ids("hangs-up"))
with client.chat.completions.create(**long_request) as stream:
    received = [chunk.choices[0].delta.content for chunk, _ in zip(stream, range(3))]
print("received:", received)

deadline = time.monotonic() + 30  # as vLLM, an aborted request is no longer unfinished; the
while (engine.has_unfinished_requests() or engine.has_unrecorded_aborts()) and time.monotonic() < deadline:
    time.sleep(0.05)  # engine records the abort (history, metrics) in the step that follows it
print("unfinished requests:", engine.get_num_unfinished_requests())
print("free blocks:", engine.kv_cache.num_free_blocks, "of", engine.kv_cache.num_blocks)
requests = engine.requests_dataframe().set_index("request_id")
print("finish reason:", requests.loc["chatcmpl-hangs-up", "finish_reason"])
print(*metric_lines('vllm:request_success_total{finished_reason="abort"'))

# %% [markdown]
# The number of tokens generated before the abort depends on how fast this machine is, so we
# do not print it; what matters is that nothing is left running and every block is free.
#
# ## A bad request
#
# A request the server cannot serve is answered with an HTTP error and an OpenAI-shaped body
# that names the offending field; the official client raises it as an exception. Nothing else
# in flight is touched, and the next request is served as usual.

# %%
try:
    client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=-1)
except BadRequestError as error:
    print(error.status_code, json.dumps(error.body, indent=1))

reply = client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0,
                                       **ids("after-the-400"))
print("still serving:", repr(reply.choices[0].message.content))

# %% [markdown]
# A prompt plus `max_tokens` longer than the model's context is refused before it reaches the
# scheduler, with vLLM's wording:

# %%
try:
    client.chat.completions.create(model=model, messages=question, max_tokens=5000)
except BadRequestError as error:
    print(error.status_code, error.body["message"])

# %% [markdown]
# `%llm stop` shuts the server down; the engine is the notebook's again, to step by hand.

# %%
# NBVAL_IGNORE_OUTPUT
%llm stop

# %% [markdown]
# ## Exercises
#
# 1. Send two streamed requests at once (two threads, or `AsyncOpenAI` with
#    `asyncio.gather`) and print `engine.history` for their steps: in which steps do both
#    requests decode in the same batch?
# 2. Serve with an API key (`%llm serve --port {port} --api-key secret`): what does a client
#    without the key receive, and which endpoints stay open?
# 3. Ask for `logprobs=True, top_logprobs=3` in a chat request and compare the alternatives the
#    model considered with the token it chose.
