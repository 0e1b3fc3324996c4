"""The engines' internal KV-transfer service's generated modules (kv_transfer.proto,
jaxserve.kv.v1.KVTransfer). Regenerate with scripts/gen_proto.sh."""
