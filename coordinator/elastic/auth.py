"""Proof that a call to the driver comes from the job.

Each job gets a fresh 256-bit secret (`new_secret`), which reaches only its
workers, through their environment ($COORDINATOR_DRIVER_SECRET, exported by
mpirun). Every call carries, in its metadata, a timestamp, a random nonce and
an HMAC-SHA256 under the secret over the method, the timestamp, the nonce and
the serialized request. The driver refuses (UNAUTHENTICATED), and logs, a
call whose HMAC is missing or wrong, whose timestamp is more than MAX_SKEW
seconds off, or whose nonce it has already seen (a replay).

The server side checks the HMAC over the request's bytes as received, before
parsing them; a request that then fails to parse is answered with
INVALID_ARGUMENT (gRPC's own answer would be INTERNAL).
"""

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time

import grpc

log = logging.getLogger("coordinator.elastic")

SECRET_ENV = "COORDINATOR_DRIVER_SECRET"
ADDRESS_ENV = "COORDINATOR_DRIVER_ADDRESS"
MAC_KEY = "x-coordinator-mac"
TIME_KEY = "x-coordinator-time"
NONCE_KEY = "x-coordinator-nonce"
MAX_SKEW = 300.0
# Refusals logged one by one before the log thins out to every LOG_EVERY-th.
LOG_FIRST = 10
LOG_EVERY = 1000


def new_secret() -> str:
    return secrets.token_hex(32)


def secret_from_env(environ=None) -> bytes:
    environ = os.environ if environ is None else environ
    value = environ.get(SECRET_ENV, "")
    if not value:
        raise RuntimeError(f"${SECRET_ENV} is not set: this process was not started by the "
                           "job's launcher, so it cannot talk to the driver")
    return value.encode()


def _key(secret):
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def mac(secret, method: str, timestamp: str, nonce: str, body: bytes) -> str:
    msg = b"\0".join([method.encode(), timestamp.encode(), nonce.encode(), body])
    return hmac.new(_key(secret), msg, hashlib.sha256).hexdigest()


def signed_metadata(secret, method: str, body: bytes, now=None):
    timestamp = repr(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    return [(TIME_KEY, timestamp), (NONCE_KEY, nonce),
            (MAC_KEY, mac(secret, method, timestamp, nonce, body))]


class Verifier:
    """Checks calls against the secret and remembers nonces for MAX_SKEW."""

    def __init__(self, secret, clock=time.time):
        self._secret = _key(secret)
        self._clock = clock
        self._lock = threading.Lock()
        self._nonces = {}  # nonce -> when seen
        self._pruned = 0.0
        self.refused = 0

    def check(self, method, metadata, body):
        """None if the call is authentic, else why it is not."""
        md = {}
        for key, value in metadata or ():
            md.setdefault(key, value)
        stamp, nonce, given = md.get(TIME_KEY), md.get(NONCE_KEY), md.get(MAC_KEY)
        if not (isinstance(stamp, str) and isinstance(nonce, str) and isinstance(given, str)):
            return "no proof of the job's secret"
        expected = mac(self._secret, method, stamp, nonce, body)
        if not hmac.compare_digest(expected, given):
            return "wrong HMAC"
        try:
            when = float(stamp)
        except ValueError:
            return "malformed timestamp"
        now = self._clock()
        if not abs(now - when) <= MAX_SKEW:
            return f"timestamp {when:.0f} is more than {MAX_SKEW:.0f} s from now"
        with self._lock:
            if nonce in self._nonces:
                return "replayed nonce"
            self._nonces[nonce] = now
            if now - self._pruned > MAX_SKEW:
                self._nonces = {n: t for n, t in self._nonces.items() if now - t <= MAX_SKEW}
                self._pruned = now
        return None

    def note_refusal(self, method, peer, why):
        with self._lock:
            self.refused += 1
            count = self.refused
        if count <= LOG_FIRST or count % LOG_EVERY == 0:
            log.warning("driver: refused a call to %s from %s: %s (%d refused so far)",
                        method, peer, why, count)


class _Packed:
    __slots__ = ("raw", "message", "error")

    def __init__(self, raw, message, error):
        self.raw, self.message, self.error = raw, message, error


class ServerAuth(grpc.ServerInterceptor):
    """Wraps every handler: the HMAC is checked over the raw request bytes,
    then the request is parsed (INVALID_ARGUMENT if it does not parse)."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        deserialize = handler.request_deserializer
        verifier = self.verifier

        def parse(raw):
            try:
                return _Packed(raw, deserialize(raw), None)
            except Exception as exc:  # any decoding failure is the caller's fault
                return _Packed(raw, None, exc)

        def admit(packed, context):
            why = verifier.check(method, context.invocation_metadata(), packed.raw)
            if why is not None:
                verifier.note_refusal(method, context.peer(), why)
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"refused: {why}")
            if packed.error is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the request does not parse as {method}'s message")
            return packed.message

        if handler.response_streaming:
            inner = handler.unary_stream

            def stream(packed, context):
                yield from inner(admit(packed, context), context)

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=parse,
                response_serializer=handler.response_serializer)
        inner = handler.unary_unary

        def unary(packed, context):
            return inner(admit(packed, context), context)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=parse, response_serializer=handler.response_serializer)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class ClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Signs every call with the job's secret."""

    def __init__(self, secret):
        self._secret = _key(secret)

    def _sign(self, details, request):
        body = request.SerializeToString()
        metadata = list(details.metadata or []) + signed_metadata(
            self._secret, details.method, body)
        return _Details(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._sign(client_call_details, request), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._sign(client_call_details, request), request)
