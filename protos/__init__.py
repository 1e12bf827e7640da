"""The contracts: generated from the .proto files beside this one by `make protos`, and the one
convention of the wire that is not a message."""

# Trailing metadata key of a transient refusal (RESOURCE_EXHAUSTED: a full queue, a wait beyond the
# queue limit or the deadline): milliseconds after which to retry. Clients decide on it and the
# status code, never on the message's words.
RETRY_AFTER_KEY = "scoremap-retry-after-ms"
