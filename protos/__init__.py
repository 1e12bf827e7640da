"""The contracts: generated from the .proto files beside this one by `make protos`."""
