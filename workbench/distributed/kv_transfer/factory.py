"""The connector of an engine's ``kv_transfer_config`` (vLLM's ``KVConnectorFactory``): its
scheduler side, and its runner wrapped with its worker side."""

from __future__ import annotations

import uuid

from workbench.distributed.kv_transfer.base import KVConnectorRole
from workbench.distributed.kv_transfer.connector_runner import KVConnectorRunner
from workbench.distributed.kv_transfer.in_process_connector import InProcessConnector

#: kv_connector name -> class.
CONNECTORS = {"InProcessConnector": InProcessConnector}


def bytes_per_block(model_config, block_size: int) -> int:
    """One block's keys and values over every layer, in bytes."""
    per_token = model_config.num_kv_heads * model_config.head_dim * model_config.dtype.itemsize
    return 2 * model_config.num_layers * block_size * per_token


def create_kv_connector(config, model_config, block_size: int, runner, clock):
    """(scheduler-side connector, the runner wrapped with the worker side) for ``config``
    (a KVTransferConfig); ``engine_id`` defaults to a fresh uuid, as vLLM's."""
    cls = CONNECTORS[config.kv_connector]
    kwargs = dict(engine_id=config.engine_id or str(uuid.uuid4()), clock=clock, block_size=block_size,
                  bytes_per_block=bytes_per_block(model_config, block_size))
    scheduler_side = cls(config, KVConnectorRole.SCHEDULER, **kwargs)
    worker_side = cls(config, KVConnectorRole.WORKER, **kwargs)
    return scheduler_side, KVConnectorRunner(runner, worker_side, clock)
