"""KVConnectorRunner: a runner with the KV connector's worker side around each step (vLLM's
``KVConnectorModelRunnerMixin``), for the model runner and the simulated runner alike.

``execute`` binds the step's connector metadata, starts the loads (before the forward),
runs the wrapped runner, waits for the saves, and puts ``get_finished``'s ids and the
transfers it started on the output (``RunnerOutput.kv_connector_output``). A step that
schedules nothing while a load is in flight waits for its modelled end on the engine's clock
(a simulated or replica clock jumps; a wall clock sleeps), so an engine waiting only on
remote KV does not spin. Every other method is the wrapped runner's.
"""

from __future__ import annotations

import dataclasses
import time

from workbench.distributed.kv_transfer.base import KVConnectorOutput


class KVConnectorRunner:
    def __init__(self, runner, connector, clock) -> None:
        self.runner, self.connector, self.clock = runner, connector, clock

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.connector.register_kv_caches(getattr(self.runner, "kv_caches", None))

    def execute(self, scheduler_output, requests, grammar_bitmask=None):
        connector = self.connector
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv()
        if not scheduler_output.scheduled:
            self._wait_until(connector.next_arrival())
        output = self.runner.execute(scheduler_output, requests, grammar_bitmask)
        connector.wait_for_save()
        sending, recving = connector.get_finished(set(scheduler_output.finished_request_ids))
        connector.clear_connector_metadata()
        return dataclasses.replace(output, kv_connector_output=KVConnectorOutput(
            frozenset(sending), frozenset(recving), connector.take_transfers()))

    def next_transfer_time(self) -> float | None:
        """When the next transfer known to the worker side completes (None: none known)."""
        return self.connector.next_arrival()

    def _wait_until(self, when: float | None) -> None:
        if when is None:
            return
        delay = when - self.clock()
        if delay <= 0:
            return
        jump = getattr(self.clock, "advance", None) or getattr(self.clock, "sleep", None)
        (jump or time.sleep)(delay)
