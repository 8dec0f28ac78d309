"""The protobuf messages generated from proto/coordinator.proto.

The generated module is produced at build time (`pip install .` or
`pip install -e .`) and never edited by hand; tests/test_wire.py checks that it
matches the .proto file.
"""

try:
    from coordinator._wire import coordinator_pb2 as pb
except ImportError as exc:  # pragma: no cover - only on an unbuilt checkout
    raise ImportError(
        "coordinator's protobuf code has not been generated; install the package "
        "with `pip install -e .` (which compiles proto/*.proto)") from exc

Request = pb.Request
CachedRequest = pb.CachedRequest
RequestList = pb.RequestList
Response = pb.Response
ResponseList = pb.ResponseList
TensorSpec = pb.TensorSpec

__all__ = ["pb", "Request", "CachedRequest", "RequestList", "Response", "ResponseList",
           "TensorSpec"]
