"""IPython magics: ``%load_ext workbench``, then ``%llm COMMAND ...`` (``%llm`` alone lists
them a line each, grouped, generated from the argument definitions below; ``%llm help
COMMAND`` gives one command's every option) and ``%%llm`` (the cell is a prompt).

``%llm load`` builds the teaching engine (:func:`workbench.config.teaching_config`: tens
of blocks, a budget of tens of tokens) unless told otherwise, and binds its LLMEngine in the
notebook as ``engine`` (``--as NAME`` for another name). Commands without a loaded engine
load that default first. Bad arguments print a usage line (IPython's UsageError), never a
traceback; so do errors the engine reports about a request (ValueError).

While ``%llm serve`` serves the engine, its engine thread owns it: the commands that drive
it (load, generate, chat, add, step, run, replay) refuse; the views show its live state.
``%llm replay`` keeps its run forkable (a copy of the engine as it was before it), so that
``%llm fork STEP --policy spf`` branches it at a step and compares the two.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import threading
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from workbench.config import EngineConfig
from workbench.config import EngineArgs
from workbench.sampling_params import SamplingParams

DRIVING_COMMANDS = ("load", "generate", "chat", "add", "step", "run", "profile", "replay")
SHOW_CHOICES = ("blocks", "timeline", "requests", "scheduler", "stats")
CLUSTER_VIEWS = ("summary", "requests", "decisions", "timeline")
#: How ``%llm`` alone groups the commands (every command is in one group).
COMMAND_GROUPS = {
    "engine": ("load", "generate", "chat", "cluster"),
    "requests": ("add", "step", "run", "replay", "compare", "fork"),
    "views": ("show", "player", "dashboard", "profile"),
    "serving": ("serve", "stop"),
    "exercises": ("exercise",),
    "help": ("help",),
}
ENGINE_FLAGS = "engine options"  # the argument group of EngineArgs' flags


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one clean line in a notebook) instead of exiting."""

    def error(self, message: str):
        raise UsageError(f"{message}\n{self.format_usage().strip()}")

    def exit(self, status: int = 0, message: str | None = None):
        raise UsageError(message or self.format_usage().strip())


def _sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                        help=f"tokens to generate at most (default: {max_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 is greedy (default: 0)")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: none)")


def build_parser() -> _Parser:
    """The ``%llm`` command line: one subcommand per command, help from these definitions."""
    parser = _Parser(prog="%llm", add_help=False,
                     description="Drive and inspect a workbench engine from a notebook.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    load = sub.add_parser("load", add_help=False, help="build an engine (the teaching engine unless --no-teaching) "
                          "and bind it in the notebook")
    load.add_argument("model", nargs="?", default=None, metavar="MODEL", help="HF directory or hub id (default: the embedded model)")
    load.add_argument("--as", dest="name", default="engine", metavar="NAME", help="variable to bind the engine to (default: engine)")
    load.add_argument("--no-teaching", action="store_true",
                      help="start from EngineConfig() defaults instead of the small teaching engine")
    load.add_argument("--lora", nargs="+", default=[], metavar="NAME=PATH",
                      help="LoRA adapters (PEFT directories) for `add --lora NAME`; a NAME alone is "
                      "a shipped adapter (errors, timon); implies --enable-lora")
    EngineArgs.add_cli_args(load, exclude=("model",), keep_defaults=False)
    gen = sub.add_parser("generate", add_help=False, help="generate a continuation and print it")
    gen.add_argument("prompt", nargs="+", metavar="PROMPT", help="the prompt (quote it, or let the words join)")
    _sampling_options(gen, 64)
    chat = sub.add_parser("chat", add_help=False, help="one user turn through the chat template")
    chat.add_argument("message", nargs="+", metavar="MESSAGE", help="the user's message")
    _sampling_options(chat, 64)
    add = sub.add_parser("add", add_help=False, help="queue a request without running it")
    add.add_argument("prompt", nargs="+", metavar="PROMPT", help="the prompt (quote it, or let the words join)")
    add.add_argument("--id", default=None, metavar="ID", help="request id (default: one is made up, req-N)")
    add.add_argument("--priority", type=int, default=0, metavar="P", help="smaller is served first under policy priority")
    add.add_argument("--lora", default=None, metavar="NAME", help="run it under this adapter of `load --lora`")
    _sampling_options(add, 32)
    step = sub.add_parser("step", add_help=False, help="advance the engine N steps (default 1); shows the last")
    step.add_argument("n", nargs="?", type=int, default=1, metavar="N", help="steps to take (default: 1)")
    sub.add_parser("run", add_help=False, help="step until every request has finished")
    profile = sub.add_parser("profile", add_help=False,
                             help="run N steps under torch.profiler; print the top operators, write the trace")
    profile.add_argument("n", type=int, metavar="N", help="steps to profile")
    profile.add_argument("--dir", default=None, metavar="DIR", help="trace directory (default: torch_profiler_dir, else ./profiles)")
    show = sub.add_parser("show", add_help=False, help="a view of the engine")
    show.add_argument("what", choices=SHOW_CHOICES, help="the view")
    sub.add_parser("player", add_help=False, help="the StepPlayer: scrub through the recorded steps")
    sub.add_parser("dashboard", add_help=False, help="the EngineDashboard: drive the engine and watch it")
    replay = sub.add_parser("replay", add_help=False, help="run a Workload (a notebook variable) on the engine")
    replay.add_argument("workload", metavar="WORKLOAD", help="name of a Workload variable")
    replay.add_argument("--clock", choices=["steps", "wall"], default=None,
                        help="the workload's own clock (default); given, it must be that one")
    compare = sub.add_parser("compare", add_help=False,
                             help="run a Workload under several configs (the engine's config, changed)")
    compare.add_argument("workload", metavar="WORKLOAD", help="name of a Workload variable")
    compare.add_argument("--policies", nargs="+", default=[], metavar="POLICY",
                         help="one run per policy (fcfs, priority, spf)")
    compare.add_argument("--configs", nargs="+", default=[], metavar="NAME=VAR",
                         help="one run per EngineConfig or dict-of-overrides variable")
    fork = sub.add_parser("fork", add_help=False,
                          help="branch the last replay (or --run RUN) at STEP with changes; compare both")
    fork.add_argument("step", type=int, metavar="STEP", help="the first step the changes shape")
    fork.add_argument("--run", default=None, metavar="RUN",
                      help="a RunResult variable (default: the last %%llm replay)")
    fork.add_argument("--policy", default=None, metavar="POLICY", help="fcfs, priority or spf from STEP on")
    fork.add_argument("--max-num-seqs", type=int, default=None, metavar="N", help="sequence cap from STEP on")
    fork.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N", help="token budget from STEP on")
    fork.add_argument("--abort", nargs="+", default=[], metavar="ID", help="abort these requests at STEP")
    fork.add_argument("--as", dest="name", default="branch", metavar="NAME",
                      help="variable to bind the branch's RunResult to (default: branch)")
    cluster = sub.add_parser("cluster", add_help=False,
                             help="N engines behind a router (simulated unless --real); --workload runs one")
    cluster.add_argument("n", type=int, metavar="N", help="the number of replicas")
    cluster.add_argument("--router", default="round_robin", metavar="ROUTER",
                         help="round_robin, least_requests, power_of_two, session, cache_aware, llm_d, precise_prefix")
    cluster.add_argument("--real", action="store_true", help="real engines (default: simulated, the cost model)")
    cluster.add_argument("--workload", default=None, metavar="WORKLOAD", help="a Workload variable to run on it")
    cluster.add_argument("--show", default="summary", choices=CLUSTER_VIEWS, metavar="VIEW",
                         help=f"what to show of the run: {', '.join(CLUSTER_VIEWS)} (default: summary)")
    cluster.add_argument("--as", dest="name", default="cluster", metavar="NAME",
                         help="variable for the Cluster (default: cluster); its run is NAME_result")
    EngineArgs.add_cli_args(cluster, exclude=("model",), keep_defaults=False)
    serve = sub.add_parser("serve", add_help=False, help="serve this engine over HTTP (OpenAI API)")
    serve.add_argument("--host", default="127.0.0.1", metavar="HOST", help="(default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, metavar="PORT", help="(default: 8000)")
    serve.add_argument("--api-key", default=None, metavar="KEY", help="require this bearer token (default: none)")
    sub.add_parser("stop", add_help=False, help="stop serving; the engine is yours to step again")
    exercise = sub.add_parser("exercise", add_help=False,
                              help="a self-grading exercise: its stub into the next cell, or --check a solution")
    exercise.add_argument("name", metavar="NAME", help="admission, policy, eviction, chunked_prefill or rejection")
    exercise.add_argument("--check", default=None, metavar="VAR",
                          help="grade this notebook variable (the filled-in stub) step by step")
    topic = sub.add_parser("help", add_help=False, help="every option of one command")
    topic.add_argument("topic", nargs="?", default=None, metavar="COMMAND", choices=[*sub.choices],
                       help="the command (none: the command list)")
    return parser


def _subcommands(parser: _Parser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def command_line(name: str, command: argparse.ArgumentParser) -> str:
    """One command's call as typed: ``%llm add PROMPT [--id ID] ...``, positionals first;
    an engine-flags group is one ``[ENGINE FLAGS]``."""
    engine_flags = next((g._group_actions for g in command._action_groups if g.title == ENGINE_FLAGS), [])
    words, options = [f"%llm {name}"], []
    for action in command._actions:
        if action in engine_flags:
            continue
        if not action.option_strings:
            word = "|".join(action.choices) if action.choices and action.metavar is None else action.metavar
            words.append(f"[{word}]" if action.nargs == "?" else word)
        elif action.nargs == 0:
            options.append(f"[{action.option_strings[0]}]")
        else:
            more = " ..." if action.nargs == "+" else ""
            metavar = action.metavar or "|".join(action.choices or []) or action.dest.upper()
            options.append(f"[{action.option_strings[0]} {metavar}{more}]")
    return " ".join(words + options + (["[ENGINE FLAGS]"] if engine_flags else []))


def help_text(parser: _Parser, topic: str | None = None) -> str:
    """``%llm`` alone: a line per command, grouped, from the parser; ``topic``: that
    command's full help (``%llm help load``: the engine flags)."""
    sub = _subcommands(parser)
    if topic is not None:
        return sub.choices[topic].format_help().replace("usage: ", "", 1)
    summaries = {choice.dest: choice.help for choice in sub._choices_actions}
    lines = [f"{parser.description} `%llm help COMMAND` gives a command's every option."]
    for group, names in COMMAND_GROUPS.items():
        lines.append(f"{group}:")
        lines += [f"  {command_line(name, sub.choices[name]):<48}  {summaries[name]}" for name in names]
    lines.append(f"  {'%%llm [--max-tokens N] [--temperature T] [--seed S]':<48}  the cell body is the prompt")
    return "\n".join(lines)


@magics_class
class WorkbenchMagics(Magics):
    """Holds one LLM (``self.current``, its engine bound in the notebook) per IPython session."""

    current = None
    server = None  # (uvicorn.Server, its thread, AsyncLLM, url) while serving
    last_run = None  # the RunResult of the last %llm replay (what %llm fork branches)

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell, **kwargs)
        self.parser = build_parser()
        self._ids = itertools.count()
        #: The adapters of the latest ``load --lora``, by name.
        self.loras: dict = {}

    # ------------------------------------------------------------ dispatch
    @line_cell_magic
    def llm(self, line: str, cell: str | None = None):
        import shlex

        try:
            words = shlex.split(line)
        except ValueError as error:
            raise UsageError(f"%llm: {error}") from None
        if cell is not None:
            words = ["generate", *words, cell.strip()]
        if not words:
            print(help_text(self.parser))
            return None
        options = self.parser.parse_args(words)
        if self.server is not None and options.command in DRIVING_COMMANDS:
            raise UsageError(
                f"the engine is being served at {self.server[3]}; `%llm stop` before `%llm {options.command}`"
            )
        try:
            return getattr(self, f"_cmd_{options.command}")(options)
        except (ValueError, KeyError) as error:
            raise UsageError(f"%llm {options.command}: {error}") from None

    @property
    def engine(self):
        return self._get_llm().engine

    def _get_llm(self):
        if self.current is None:
            self._cmd_load(self.parser.parse_args(["load"]))
        return self.current

    def _variable(self, name: str):
        try:
            return self.shell.user_ns[name]
        except KeyError:
            raise UsageError(f"no variable {name!r} in the notebook") from None

    # ------------------------------------------------------------ commands
    def _cmd_load(self, options):
        from workbench.entrypoints.llm import LLM
        from workbench.config import teaching_config

        overrides = {f.name: getattr(options, f.name) for f in dataclasses.fields(EngineConfig)
                     if getattr(options, f.name, None) is not None}
        overrides["model"] = options.model
        loras = self._lora_requests(options.lora)
        if loras:
            overrides["enable_lora"] = True
            overrides.setdefault("max_loras", min(len(loras), 2))
        config = EngineConfig(**overrides) if options.no_teaching else teaching_config(**overrides)
        self.current = LLM(**dataclasses.asdict(config))
        self.loras = loras
        for lora in loras.values():
            self.current.engine.add_lora(lora)
        if self.shell is not None:
            self.shell.user_ns[options.name] = self.current.engine
        return self.current.engine

    def _params(self, options) -> SamplingParams:
        return SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature, seed=options.seed)

    def _cmd_generate(self, options):
        prompt = " ".join(options.prompt)
        out = self._get_llm().generate([prompt], self._params(options), use_tqdm=False)[0]
        print(prompt + out.outputs[0].text)

    def _cmd_chat(self, options):
        message = {"role": "user", "content": " ".join(options.message)}
        out = self._get_llm().chat([message], self._params(options), use_tqdm=False)[0]
        print(out.outputs[0].text)

    @staticmethod
    def _lora_requests(items: list[str]) -> dict:
        """``NAME=PATH`` (or a shipped adapter's NAME) -> LoRARequest, ids from 1."""
        from workbench.lora.request import LoRARequest
        from workbench.model.loader import embedded_lora_path

        loras = {}
        for item in items:
            name, sep, path = item.partition("=")
            try:
                path = path if sep else str(embedded_lora_path(name))
            except ValueError as exc:
                raise UsageError(f"--lora {item}: {exc} Give NAME=PATH for another one.") from None
            loras[name] = LoRARequest(name, len(loras) + 1, path)
        return loras

    def _cmd_add(self, options):
        engine = self.engine
        request_id = options.id or self._new_id(engine)
        lora = None
        if options.lora is not None:
            lora = self.loras.get(options.lora)
            if lora is None:
                raise UsageError(f"--lora {options.lora}: no such adapter; `%llm load --lora NAME=PATH` "
                                 f"loaded {sorted(self.loras)}.")
        engine.add_request(request_id, " ".join(options.prompt), self._params(options),
                           priority=options.priority, lora_request=lora)
        print(f"added {request_id!r}")
        return None

    def _new_id(self, engine) -> str:
        taken = set(engine.scheduler.requests)
        while (rid := f"req-{next(self._ids)}") in taken:
            pass
        return rid

    def _cmd_step(self, options):
        engine = self.engine
        for _ in range(options.n):  # an abort left unrecorded gets its step too
            if not (engine.has_unfinished_requests() or engine.has_unrecorded_aborts()):
                break
            for out in engine.step():
                if out.finished:
                    print(out)
        return engine.history[-1] if len(engine.history) else None

    def _cmd_run(self, options):
        engine = self.engine
        while engine.has_unfinished_requests() or engine.has_unrecorded_aborts():
            for out in engine.step():
                if out.finished:
                    print(out)
        return engine.history[-1] if len(engine.history) else None

    def _cmd_profile(self, options):
        """Profile ``n`` steps (fewer if the engine runs out of work); returns the trace's path."""
        if options.n < 1:
            raise ValueError(f"N must be >= 1, got {options.n}.")
        engine = self.engine
        engine.start_profile(options.dir or engine.config.torch_profiler_dir or "profiles")
        try:
            for _ in range(options.n):
                if not engine.has_unfinished_requests():
                    break
                engine.step()
        finally:
            path = engine.stop_profile()
        return path

    def _cmd_show(self, options):
        from workbench.viz import BlockMap, RequestTimeline
        from workbench.viz.source import ViewSource

        engine = self.engine
        source = ViewSource(engine, live=self.server is None)
        if options.what == "blocks":
            return BlockMap(source)
        if options.what == "timeline":
            return RequestTimeline(source)
        if options.what == "requests":
            return engine.requests_dataframe()
        if options.what == "scheduler":
            display(engine.scheduler)
            return engine.kv_cache
        display(engine.scheduler_stats)
        return engine.history.to_dataframe()

    def _cmd_player(self, options):
        from workbench.viz import StepPlayer
        from workbench.viz.source import ViewSource

        return StepPlayer(ViewSource(self.engine, live=self.server is None))

    def _cmd_dashboard(self, options):
        from workbench.viz import EngineDashboard

        return EngineDashboard(self.engine, read_only=self.server is not None)

    def _cmd_cluster(self, options):
        from workbench.cluster import Cluster
        from workbench.lab.workload import Workload
        from workbench.viz.cluster_timeline import ClusterTimeline

        overrides = {f.name: getattr(options, f.name) for f in dataclasses.fields(EngineConfig)
                     if getattr(options, f.name, None) is not None}
        cluster = (Cluster([overrides] * options.n, router=options.router) if options.real
                   else Cluster.simulated(options.n, overrides, router=options.router))
        if self.shell is not None:
            self.shell.user_ns[options.name] = cluster
        if options.workload is None:
            return cluster
        workload = self._variable(options.workload)
        if not isinstance(workload, Workload):
            raise UsageError(f"{options.workload!r} is a {type(workload).__name__}, not a Workload")
        result = cluster.run(workload)
        if self.shell is not None:
            self.shell.user_ns[f"{options.name}_result"] = result
        views = {"summary": lambda: result, "requests": lambda: result.requests,
                 "decisions": lambda: result.decisions, "timeline": lambda: ClusterTimeline(result)}
        return views[options.show]()

    def _cmd_exercise(self, options):
        import workbench.exercises as exercises

        exercise = exercises.exercise(options.name)
        if options.check is not None:
            return exercises.check(exercise.name, self._variable(options.check))
        print(f"Exercise {exercise.number}: {exercise.title} ({exercise.notebook}).\n"
              f"Fill in the next cell, run it, then: %llm exercise {exercise.name} --check NAME")
        self.shell.set_next_input(exercise.stub)
        return None

    def _cmd_replay(self, options):
        from workbench.lab.replay import replay_workload
        from workbench.lab.workload import Workload

        workload = self._variable(options.workload)
        if not isinstance(workload, Workload):
            raise UsageError(f"{options.workload!r} is a {type(workload).__name__}, not a Workload")
        self.last_run = replay_workload(self.engine, workload, clock=options.clock, forkable=True)
        return self.last_run

    def _cmd_fork(self, options):
        from workbench.lab.replay import RunResult
        from workbench.lab.compare import compare_branches
        from workbench.viz import ComparisonView

        run = self._variable(options.run) if options.run else self.last_run
        if not isinstance(run, RunResult):
            raise UsageError(f"{options.run!r} is a {type(run).__name__}, not a RunResult" if options.run
                             else "nothing to fork: `%llm replay WORKLOAD` first, or --run RUN")
        branch = run.fork_at(options.step, policy=options.policy, max_num_seqs=options.max_num_seqs,
                             max_num_batched_tokens=options.max_num_batched_tokens, abort=options.abort)
        if self.shell is not None:
            self.shell.user_ns[options.name] = branch
        print(f"{options.name}: {branch.branch}")
        return ComparisonView(compare_branches(run, {options.name: branch}))

    def _cmd_compare(self, options):
        from workbench.lab.compare import compare_runs
        from workbench.viz import ComparisonView
        from workbench.lab.workload import Workload

        workload = self._variable(options.workload)
        if not isinstance(workload, Workload):
            raise UsageError(f"{options.workload!r} is a {type(workload).__name__}, not a Workload")
        base = self.engine.config
        configs = {policy: dataclasses.replace(base, policy=policy) for policy in options.policies}
        for item in options.configs:
            name, _, var = item.partition("=")
            value = self._variable(var or name)
            if isinstance(value, dict):
                value = dataclasses.replace(base, **value)
            if not isinstance(value, EngineConfig):
                raise UsageError(f"{var or name!r} is a {type(value).__name__}, not an EngineConfig or a dict")
            configs[name] = value
        if len(configs) < 2:
            raise UsageError("compare needs at least two configs: --policies fcfs spf, or --configs a=A b=B")
        return ComparisonView(compare_runs(workload, configs))

    def _cmd_help(self, options):
        print(help_text(self.parser, options.topic))

    def _cmd_serve(self, options):
        from workbench.engine.async_llm import AsyncLLM
        from workbench.entrypoints.openai.api_server import build_app
        from workbench.entrypoints.openai.api_server import make_server

        if self.server is not None:
            raise UsageError(f"already serving at {self.server[3]}; `%llm stop` first")
        llm = self._get_llm()
        async_llm = AsyncLLM(llm.engine)
        name = llm.engine.model_config.path.name
        app = build_app(async_llm, model_name=name, api_key=options.api_key)
        server = make_server(app, async_llm, host=options.host, port=options.port, log_level="warning")
        thread = threading.Thread(target=server.run, name="workbench-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not server.started:
            server.should_exit = True
            _shutdown(async_llm)
            raise UsageError(f"the server did not start on {options.host}:{options.port}")
        url = f"http://{options.host}:{options.port}/v1"
        self.server = (server, thread, async_llm, url)
        print(f"Serving {name!r} at {url}; `%llm dashboard` shows its scheduling, `%llm stop` ends it.")
        return url

    def _cmd_stop(self, options):
        if self.server is None:
            raise UsageError("nothing is being served")
        server, thread, async_llm, url = self.server
        server.should_exit = True
        thread.join(timeout=30)
        _shutdown(async_llm)
        self.server = None
        print(f"Stopped serving at {url}.")


def _shutdown(async_llm) -> None:
    """Stop AsyncLLM's engine thread from a cell (IPython's own event loop may be running)."""
    worker = threading.Thread(target=lambda: asyncio.run(async_llm.shutdown()))
    worker.start()
    worker.join()


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(WorkbenchMagics)
