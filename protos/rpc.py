"""DecodeService with the zero-copy codec (protos/wire.py) on both ends.

The generated stub and servicer registration serialize with `SerializeToString` /
`FromString`, which copy every payload; these use `wire.serialize` on the client and
`wire.parse_decode_request` / `wire.parse_decode_chunk` on the server instead. The bytes
on the wire are standard protobuf either way: a generated stub talks to this server and
this stub to a generated server.
"""

from __future__ import annotations

import grpc

from protos import pdspec_pb2, wire

SERVICE = pdspec_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
DECODE = f"/{SERVICE}/Decode"
DECODE_STREAM = f"/{SERVICE}/DecodeStream"
GET_INFO = f"/{SERVICE}/GetInfo"


class DecodeStub:
    """Decode takes a pdspec_pb2.DecodeRequest or a wire.WireDecodeRequest; DecodeStream an
    iterator of wire chunks (wire.stream_chunks) or pdspec_pb2.DecodeChunk messages."""

    def __init__(self, channel: grpc.Channel) -> None:
        response = pdspec_pb2.GenerateResponse.FromString
        self.Decode = channel.unary_stream(DECODE, request_serializer=wire.serialize, response_deserializer=response)
        self.DecodeStream = channel.stream_stream(
            DECODE_STREAM, request_serializer=wire.serialize, response_deserializer=response
        )
        self.GetInfo = channel.unary_unary(
            GET_INFO,
            request_serializer=pdspec_pb2.InfoRequest.SerializeToString,
            response_deserializer=pdspec_pb2.NodeInfo.FromString,
        )


def add_decode_servicer(servicer, server: grpc.Server) -> None:
    """Register `servicer` (Decode gets a wire.ParsedDecodeRequest, DecodeStream an iterator
    of wire.ParsedChunk, GetInfo a pdspec_pb2.InfoRequest)."""
    response = pdspec_pb2.GenerateResponse.SerializeToString
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode, request_deserializer=wire.parse_decode_request, response_serializer=response
        ),
        "DecodeStream": grpc.stream_stream_rpc_method_handler(
            servicer.DecodeStream, request_deserializer=wire.parse_decode_chunk, response_serializer=response
        ),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo,
            request_deserializer=pdspec_pb2.InfoRequest.FromString,
            response_serializer=pdspec_pb2.NodeInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
