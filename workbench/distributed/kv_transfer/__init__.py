"""vLLM's KV transfer: a connector split into a scheduler side and a worker side
(:mod:`.base`), the in-process connector that copies blocks between two engines of one
process over a modelled link (:mod:`.in_process_connector`, :mod:`.link`), and the runner
wrapper that calls the worker side around each step (:mod:`.connector_runner`)."""
