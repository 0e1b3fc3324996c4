"""`jaxserve router`: one `jaxserve.v1.Generation` front for many `jaxserve serve` replicas.

The parts, one concept a file:
  prefix_index.py  PrefixIndex: per replica, a radix tree over the token ids the router sent it
  policy.py        the routing policies (cache_aware, round_robin, least_load) over ReplicaView
  replica.py       Replica: one replica's channel, health watch (and SUSPECT probe), load and prefix index
  tokenize.py      the model's tokenizer at the router (text and chat -> token ids, once)
  servicer.py      RouterServicer: Generate (retry, cancel, deadline), Abort, model/server info
  disagg.py        --prefill/--decode: the prefill hop, its outcome, the KV handed to a decode engine
  prefill_deadline.py  the prefill hop's deadline, learned per prefill engine; its flags
  metrics.py       the router's Prometheus registry
  children.py      `--replicas N`: local replica processes, each on its own port and CPU set
  server.py        the router process: gRPC listen, health, reflection, auth/TLS, shutdown
  cli.py           the `jaxserve router` subcommand

The router never imports jax: it holds no model, only a tokenizer.
"""
