"""What every worker actor is: the actor shell, its config, heartbeat and stats, the cross-process
messages, the per-consumer output buffers, and the colocated worker (prefill and decode in one engine)."""
