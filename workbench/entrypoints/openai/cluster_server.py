"""``workbench serve --cluster JSON``: one OpenAI endpoint in front of a cluster of engines.

The JSON (text, or the path of a file holding it)::

    {"router": "cache_aware",                    # a name of workbench.cluster.ROUTERS
     "router_options": {"cache_threshold": 0.5}, # keyword arguments of that router
     "served_model_name": "tiny-shakespeare",    # what clients send as "model" (default: the first replica's)
     "cost_model": null,                         # simulated replicas' CostModel JSON (null: the shipped one)
     "replicas": [{"simulated": true, "num_kv_blocks": 256},
                  {"model": null, "block_size": 16}]}

``replicas`` is the pool every request is routed in: each entry is ``simulated`` (default
false: a real engine; true: the real scheduler and KV cache timed by the cost model, whose
tokens are fillers) and EngineArgs fields. The pools are keyed by role so P/D can add a
``"prefill"`` / ``"decode"`` pair beside (or instead of) ``"replicas"``; until then those
keys are refused by name.

Each replica is an engine behind its own :func:`~workbench.entrypoints.openai.api_server.build_app`
(in this process, its own engine thread). ``POST /v1/completions`` and
``/v1/chat/completions`` are routed: the prompt (the chat template rendered) is tokenized,
the router gets a :class:`~workbench.cluster.router.RoutedRequest` and one
:class:`~workbench.cluster.replica.ReplicaView` per replica (``num_requests``: the requests the
front has sent there and not finished), and the request goes to the chosen replica's app
unchanged; its answer (JSON or SSE) comes back with the header ``x-workbench-replica: i``.
Routers that read KV events get every replica's after each of its steps. ``GET /metrics``
serves every replica's ``vllm:`` series with a ``replica`` label; ``/health`` is 200 when
every engine runs; other paths (``/v1/models``, ``/tokenize``, ...) go to replica 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pathlib
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from workbench.cluster.replica import ReplicaView
from workbench.cluster.router import RoutedRequest, Router, Routing
from workbench.cluster.routers import ROUTERS
from workbench.config import EngineConfig
from workbench.core.kv_event_batch import to_kv_event_batch
from workbench.engine.async_llm import AsyncLLM
from workbench.engine.llm_engine import LLMEngine
from workbench.entrypoints.openai.api_server import build_app, prometheus_logger
from workbench.lab.run import resolve_config
from workbench.lab.sim.cost_model import as_cost_model
from workbench.lab.sim.simulate import simulated_engine
from workbench.lab.workload import WorkloadRequest
from workbench.sampling_params import SamplingParams

REPLICA_HEADER = "x-workbench-replica"
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_KEYS = {"router", "router_options", "served_model_name", "cost_model", "replicas"}
_POOLS_LATER = {"prefill", "decode"}


@dataclass
class ReplicaSpec:
    """One replica of the JSON: its engine config and whether it is simulated."""

    config: EngineConfig
    simulated: bool = False


@dataclass
class ClusterServeConfig:
    """The parsed ``--cluster`` JSON (see the module docstring)."""

    replicas: list[ReplicaSpec]
    router: str = "round_robin"
    router_options: dict = field(default_factory=dict)
    served_model_name: str | None = None
    cost_model: str | None = None

    @classmethod
    def from_json(cls, text: str | dict) -> ClusterServeConfig:
        if isinstance(text, str):
            path = pathlib.Path(text)
            if not text.lstrip().startswith("{") and path.is_file():
                text = path.read_text()
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--cluster: not JSON nor a JSON file ({exc}).") from None
        else:
            data = text
        if not isinstance(data, dict):
            raise ValueError(f"--cluster: expected a JSON object, got {type(data).__name__}.")
        later = sorted(_POOLS_LATER & set(data))
        if later:
            raise ValueError(f"--cluster: pools {later} (prefill/decode disaggregation) are not served yet; "
                             "list the engines under 'replicas'.")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise ValueError(f"--cluster: unknown key(s) {unknown}; known: {sorted(_KEYS)}.")
        entries = data.get("replicas")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"--cluster: 'replicas' must be a non-empty list of replica objects, got {entries!r}.")
        replicas = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ValueError(f"--cluster: replicas[{i}] must be an object, got {entry!r}.")
            entry = dict(entry)
            simulated = entry.pop("simulated", False)
            if not isinstance(simulated, bool):
                raise ValueError(f"--cluster: replicas[{i}].simulated must be true or false, got {simulated!r}.")
            try:
                replicas.append(ReplicaSpec(resolve_config(entry), simulated))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"--cluster: replicas[{i}]: {exc}") from None
        router = data.get("router", "round_robin")
        if router not in ROUTERS:
            raise ValueError(f"--cluster: router must be one of {sorted(ROUTERS)}, got {router!r}.")
        options = data.get("router_options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"--cluster: router_options must be an object, got {options!r}.")
        return cls(replicas, router, options, data.get("served_model_name"), data.get("cost_model"))

    def make_router(self) -> Router:
        try:
            return ROUTERS[self.router](**self.router_options)
        except TypeError as exc:
            raise ValueError(f"--cluster: router_options for {self.router!r}: {exc}") from None


class _ReplicaMetrics:
    """A collector serving every replica's registry, each sample labelled ``replica``."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self):
        families: dict[str, Metric] = {}
        for i, registry in enumerate(self.registries):
            for metric in registry.collect():
                family = families.get(metric.name)
                if family is None:
                    family = families[metric.name] = Metric(metric.name, metric.documentation, metric.type,
                                                            metric.unit)
                family.samples.extend(s._replace(labels={**s.labels, "replica": str(i)}) for s in metric.samples)
        yield from families.values()


class ClusterFront:
    """The ASGI app in front of the replicas' apps (see the module docstring)."""

    def __init__(self, engines: list[AsyncLLM], router: Router, model_name: str) -> None:
        self.engines, self.router, self.model_name = engines, router, model_name
        self.apps = [build_app(e, model_name=model_name) for e in engines]
        self.tokenizer = engines[0].engine.tokenizer
        self.in_flight = [0] * len(engines)
        self.lock = threading.Lock()  # the router is called from the loop and from engine threads
        self.start = time.monotonic()
        self.ids = itertools.count()
        #: Every routing decision: request id, path, the choice, each score per replica.
        self.decisions: list[dict] = []
        self.metrics = CollectorRegistry(auto_describe=True)
        loggers = [prometheus_logger(e, model_name) for e in engines if e.config.log_stats]
        self.metrics.register(_ReplicaMetrics([m.registry for m in loggers]))
        if router.reads_kv_events:
            for i, e in enumerate(engines):
                e.engine.on_step.append(self._kv_hook(i))

    def _kv_hook(self, index: int):
        def publish(record) -> None:
            batch = to_kv_event_batch(record.kv_events, ts=time.time())
            if batch.events:
                with self.lock:
                    self.router.on_kv_events(index, batch)
        return publish

    # ------------------------------------------------------------ routing
    def prompt_ids(self, path: str, body: dict) -> tuple[int, ...]:
        """The token ids the request's prompt starts with (what prefix routing compares)."""
        tok = self.tokenizer
        if path == "/v1/chat/completions":
            messages = body.get("messages") or []
            try:
                ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            except Exception:  # no template, odd messages: the replica will say what is wrong
                ids = tok.encode("\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict)))
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]
            ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        ids = tuple(int(t) for t in ids if isinstance(t, int) and not isinstance(t, bool))
        return ids or (0,)

    def views(self) -> list[ReplicaView]:
        out = []
        for i, e in enumerate(self.engines):
            engine = e.engine
            kv = engine.kv_cache
            out.append(ReplicaView(i, self.in_flight[i], len(engine.scheduler.waiting), len(engine.scheduler.running),
                                   kv.usage, kv.num_free_blocks, engine.config.block_size,
                                   time.monotonic() - self.start, engine))
        return out

    def route(self, path: str, body: dict) -> tuple[str, int]:
        rid = f"route-{next(self.ids)}"
        request = WorkloadRequest(rid, self.prompt_ids(path, body), SamplingParams(max_tokens=1))
        with self.lock:
            routed = RoutedRequest(rid, request, time.monotonic() - self.start)
            answer = self.router.route(routed, self.views())
            routing = answer if isinstance(answer, Routing) else Routing(answer)
            choice = routing.replica
            if not (isinstance(choice, int) and 0 <= choice < len(self.engines)):
                raise ValueError(f"router {self.router.name!r} chose replica {choice!r}; "
                                 f"replicas are 0..{len(self.engines) - 1}.")
            self.in_flight[choice] += 1
            row = {"request_id": rid, "path": path, "replica": choice}
            for name, values in routing.scores.items():
                row.update({f"{name}_{i}": float(v) for i, v in enumerate(values)})
            self.decisions.append(row)
        return rid, choice

    def finished(self, rid: str, replica: int) -> None:
        with self.lock:
            self.in_flight[replica] -= 1
            self.router.on_finished(replica, rid)

    # ------------------------------------------------------------ ASGI
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            await self._plain(send, 200, generate_latest(self.metrics), CONTENT_TYPE_LATEST)
        elif path == "/health":
            down = [i for i, e in enumerate(self.engines) if not e.is_running]
            await self._plain(send, 503 if down else 200, f"replicas not running: {down}".encode() if down else b"",
                              "text/plain")
        elif scope["method"] == "POST" and path in ROUTED_PATHS:
            await self._routed(scope, receive, send)
        else:
            await self.apps[0](scope, receive, send)

    async def _routed(self, scope, receive, send) -> None:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = {}
        rid, choice = self.route(scope["path"], parsed if isinstance(parsed, dict) else {})
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def send_marked(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), str(choice).encode())]}
            await send(message)

        try:
            await self.apps[choice](scope, replay, send_marked)
        finally:
            self.finished(rid, choice)

    @staticmethod
    async def _plain(send, status: int, body: bytes, content_type: str) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type.encode())]})
        await send({"type": "http.response.body", "body": body})


def build_engines(config: ClusterServeConfig) -> list[AsyncLLM]:
    """One AsyncLLM (an engine thread in this process) per replica of ``config``."""
    cost_model = as_cost_model(config.cost_model) if any(r.simulated for r in config.replicas) else None
    engines = []
    for spec in config.replicas:
        engine = (simulated_engine(spec.config, cost_model, {}) if spec.simulated else LLMEngine(spec.config))
        engines.append(AsyncLLM(engine))
    return engines


def build_cluster_app(config: ClusterServeConfig | str | dict) -> ClusterFront:
    """The front app over freshly built replicas (shut them down with :func:`shutdown`)."""
    if not isinstance(config, ClusterServeConfig):
        config = ClusterServeConfig.from_json(config)
    router = config.make_router()
    engines = build_engines(config)
    name = config.served_model_name or config.replicas[0].config.model or "tiny-shakespeare"
    return ClusterFront(engines, router, name)


def shutdown(front: ClusterFront) -> None:
    for e in front.engines:
        asyncio.run(e.shutdown())


def serve_cluster(args) -> int:
    """``workbench serve --cluster JSON`` (host, port, log level from ``args``) until interrupted."""
    import sys

    import uvicorn

    try:
        front = build_cluster_app(args.cluster)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"Serving {front.model_name!r} from {len(front.engines)} replicas behind {front.router.name} on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.Server(uvicorn.Config(front, host=args.host, port=args.port, log_level=args.log_level)).run()
    finally:
        shutdown(front)
    return 0
