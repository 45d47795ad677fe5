"""IPython magics: ``%load_ext workbench.magics`` then ``%llm ...`` / ``%%llm``.

    %llm load [MODEL] [--key value ...]   create the session's LLM (EngineConfig fields as options)
    %llm generate PROMPT [--max-tokens N] [--temperature T]
    %%llm [--max-tokens N] [--temperature T]     the cell body is the prompt
    %llm chat MESSAGE                     one user turn through the chat template
    %llm add ID PROMPT                    queue a request on the engine without running it
    %llm step [N]                         advance the engine N steps, show the last StepRecord
    %llm status                           the scheduler's queues and the KV cache
    %llm history                          the step history as a DataFrame
    %llm dashboard                        the interactive EngineDashboard
    %llm serve [--host H] [--port P] [--api-key K]   serve this engine over HTTP (OpenAI API)
    %llm stop                             stop serving; the engine is yours to step again

The LLM is created on first use with the embedded default model. While it is served, the
server's engine thread owns the engine: the commands that drive it (generate, chat, add,
step) refuse, the ones that read it (status, history, dashboard) show its live state.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import threading
import time

from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from workbench.sampling_params import SamplingParams


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def _sampling_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%llm", add_help=False, exit_on_error=False)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    return parser


@magics_class
class WorkbenchMagics(Magics):
    """Holds one LLM per IPython session (``self.current``)."""

    current = None
    server = None  # (uvicorn.Server, its thread, AsyncLLM, url) while serving

    def _get_llm(self):
        if self.current is None:
            from workbench.llm import LLM

            self.current = LLM()
        return self.current

    @line_cell_magic
    def llm(self, line: str, cell: str | None = None):
        words = shlex.split(line)
        if cell is not None:
            if self.server is not None:
                raise RuntimeError(f"the engine is being served at {self.server[3]}; `%llm stop` first")
            options, _ = _sampling_parser().parse_known_args(words)
            return self._generate(cell.strip(), options)
        if not words:
            print(__doc__)
            return None
        command, rest = words[0], words[1:]
        handler = getattr(self, f"_cmd_{command}", None)
        if handler is None:
            raise ValueError(
                f"unknown %llm command {command!r}; one of: load, generate, chat, add, step, "
                "status, history, dashboard, serve, stop"
            )
        if self.server is not None and command in ("load", "generate", "chat", "add", "step"):
            raise RuntimeError(
                f"the engine is being served at {self.server[3]}; `%llm stop` before `%llm {command}`"
            )
        return handler(rest)

    def _generate(self, prompt: str, options):
        params = SamplingParams(
            temperature=options.temperature, max_tokens=options.max_tokens, seed=options.seed
        )
        out = self._get_llm().generate([prompt], params, use_tqdm=False)[0]
        print(prompt + out.outputs[0].text)
        return None

    def _cmd_load(self, args: list[str]):
        from workbench.llm import LLM

        model = args[0] if args and not args[0].startswith("--") else None
        pairs = args[1:] if model else args
        kwargs = {}
        for key, value in zip(pairs[::2], pairs[1::2]):
            kwargs[key.lstrip("-").replace("-", "_")] = _parse_value(value)
        self.current = LLM(model=model, **kwargs)
        return self.current

    def _cmd_generate(self, args: list[str]):
        options, prompt = _sampling_parser().parse_known_args(args)
        return self._generate(" ".join(prompt), options)

    def _cmd_chat(self, args: list[str]):
        out = self._get_llm().chat(
            [{"role": "user", "content": " ".join(args)}],
            SamplingParams(temperature=0, max_tokens=64),
            use_tqdm=False,
        )[0]
        print(out.outputs[0].text)

    def _cmd_add(self, args: list[str]):
        if len(args) < 2:
            raise ValueError("usage: %llm add ID PROMPT")
        self._get_llm().engine.add_request(
            args[0], " ".join(args[1:]), SamplingParams(temperature=0, max_tokens=32)
        )

    def _cmd_step(self, args: list[str]):
        engine = self._get_llm().engine
        for _ in range(int(args[0]) if args else 1):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    print(out)
        return engine.history[-1] if len(engine.history) else None

    def _cmd_status(self, args: list[str]):
        engine = self._get_llm().engine
        display(engine.scheduler)
        display(engine.kv_cache)

    def _cmd_history(self, args: list[str]):
        return self._get_llm().engine.history.to_dataframe()

    def _cmd_dashboard(self, args: list[str]):
        from workbench.viz.dashboard import EngineDashboard

        return EngineDashboard(self._get_llm().engine, read_only=self.server is not None)

    def _cmd_serve(self, args: list[str]):
        import uvicorn

        from workbench.serving import AsyncLLM, build_app

        if self.server is not None:
            raise RuntimeError(f"already serving at {self.server[3]}; `%llm stop` first")
        parser = argparse.ArgumentParser(prog="%llm serve", add_help=False, exit_on_error=False)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--api-key", default=None)
        options = parser.parse_args(args)
        llm = self._get_llm()
        async_llm = AsyncLLM(llm.engine)
        name = llm.engine.model_config.path.name
        app = build_app(async_llm, model_name=name, api_key=options.api_key)
        server = uvicorn.Server(
            uvicorn.Config(app, host=options.host, port=options.port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, name="workbench-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not server.started:
            server.should_exit = True
            _shutdown(async_llm)
            llm.engine.stream_outputs = False
            raise RuntimeError(f"the server did not start on {options.host}:{options.port}")
        url = f"http://{options.host}:{options.port}/v1"
        self.server = (server, thread, async_llm, url)
        print(f"Serving {name!r} at {url}; `%llm dashboard` shows its scheduling, `%llm stop` ends it.")
        return url

    def _cmd_stop(self, args: list[str]):
        if self.server is None:
            raise RuntimeError("nothing is being served")
        server, thread, async_llm, url = self.server
        server.should_exit = True
        thread.join(timeout=30)
        _shutdown(async_llm)
        async_llm.engine.stream_outputs = False
        self.server = None
        print(f"Stopped serving at {url}.")


def _shutdown(async_llm) -> None:
    """Stop AsyncLLM's engine thread from a cell (IPython's own event loop may be running)."""
    worker = threading.Thread(target=lambda: asyncio.run(async_llm.shutdown()))
    worker.start()
    worker.join()


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(WorkbenchMagics)
