"""pdspec wire protocol: pdspec.proto, its generated code, the TensorPB codec, proposal
encodings, the contract fingerprint and the decode-boundary validator (docs/design.md §3).

Generated code (pdspec_pb2*.py) is committed, made by `make proto` with the pinned
grpcio-tools; tests/protos/test_generated.py fails if it drifts from pdspec.proto.
"""
