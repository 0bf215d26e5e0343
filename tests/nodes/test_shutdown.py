"""NodeShell.stop returns only once gRPC's serving thread is done with the calls it drained.

grpcio sets the event server.stop() returns just before its serving thread (a daemon) drops the
last call's state and callbacks. A decode node's callback held its request, so the thread freed
tensors after the node's main thread had gone on to exit; when the interpreter was finalising by
then, the thread's wait for the GIL in torch's tensor deallocation ended in pthread_exit, whose
unwinding through noexcept C++ aborted the process ("terminate called without an active
exception", exit status -6, after every stream had ended OK).
"""

from __future__ import annotations

import threading

import grpc

from decode_node.server import _canceller
from pdspec.serving import NodeShell

SERVICE = "pdspec.test.Shutdown"
# How long the object a drained call's callback holds takes to be freed, at most: a stop that
# returned meanwhile (the bug) is seen; one that waits for it takes this long.
FREE_S = 1.0


def test_stop_returns_after_grpc_freed_what_the_drained_calls_held():
    release, stop_returned = threading.Event(), threading.Event()
    freed_before_return: list[bool] = []

    class Callback:  # a decode stream's cancel callback held its request, tensors and all
        def __call__(self) -> None:
            pass

        def __del__(self) -> None:
            stop_returned.wait(FREE_S)
            freed_before_return.append(not stop_returned.is_set())

    def hold(request: bytes, context):
        context.add_callback(Callback())
        yield b"started"
        release.wait(30)
        yield b"done"

    shell = NodeShell(SERVICE, host="127.0.0.1", port=0, streams=2)
    handler = grpc.unary_stream_rpc_method_handler(hold)
    shell.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Hold": handler}),))
    begin_stop = shell.server.stop

    def stop_then_release(grace):  # the call ends while the server drains it, as under SIGTERM
        event = begin_stop(grace)  # with a grace: returns once the server refuses new calls
        release.set()
        return event

    shell.server.stop = stop_then_release
    shell.start()
    assert len(shell._serving_threads) == 1
    with grpc.insecure_channel(f"127.0.0.1:{shell.port}") as channel:
        stream = channel.unary_stream(f"/{SERVICE}/Hold")(b"", timeout=30)
        assert next(stream) == b"started"

        def stop() -> None:
            shell.stop(30)
            stop_returned.set()

        stopper = threading.Thread(target=stop)
        stopper.start()
        assert list(stream) == [b"done"]
        stopper.join(30)
    assert stop_returned.is_set()
    assert freed_before_return == [True]
    assert not any(t.is_alive() for t in shell._serving_threads)


def test_the_decode_cancel_callback_does_not_keep_the_request_alive():
    class Engine:
        def __init__(self) -> None:
            self.cancelled: list[object] = []

        def cancel(self, request) -> None:
            self.cancelled.append(request)

    class Request:
        pass

    engine, request = Engine(), Request()
    cancel = _canceller(engine, request)
    cancel()
    assert engine.cancelled == [request]
    engine.cancelled.clear()
    del request
    cancel()  # the stream ended and took its request with it: nothing to cancel
    assert engine.cancelled == []
