"""What a step's KV connector did, in words (the player's notes): loads started
(WAITING_FOR_REMOTE_KVS, with blocks, bytes and the link's modelled time), loads landed, and
held blocks freed once a peer read them. Read from ``StepRecord.kv_connector_output`` only."""

from __future__ import annotations


def kv_transfer_notes(record) -> list[str]:
    kv = getattr(record, "kv_connector_output", None)
    if kv is None:
        return []
    notes = [f"{t.request_id} waits for remote KV (WAITING_FOR_REMOTE_KVS): {t.num_blocks} blocks, "
             f"{t.num_bytes / 1024:.1f} KiB from {t.remote_engine_id}'s {t.remote_request_id}, "
             f"{1e3 * t.seconds:.3f} ms on the link" for t in kv.transfers]
    notes += [f"{rid}'s remote KV landed: it is scheduled like a prefix hit from the next step"
              for rid in sorted(kv.finished_recving)]
    notes += [f"{rid}'s blocks, held for a peer, were read: freed" for rid in sorted(kv.finished_sending)]
    return notes
