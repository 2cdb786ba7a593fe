"""What one client can make the OpenAI server hold: a bounded request body and a bounded queue.

An ASGI middleware on vLLM's app (vLLM's --middleware hook) in front of POST /v1/*:
- a body past --max-request-body-bytes gets 413 naming the limit; it is read no further than that;
- a body that does not arrive within --request-body-timeout seconds (a slow or stalled client) gets
  408, so a client cannot hold a queue place by sending nothing;
- past --max-num-seqs running plus --max-waiting-requests waiting, a request gets 503 with Retry-After
  at once, instead of the server queueing without end (each queued request holds its prompt and
  its tokenization in memory).
The prompt length is vLLM's own check (--max-model-len: 400 naming it); a client that disconnects
has its request aborted by vLLM's server, which frees its KV blocks; an idle keep-alive connection
is closed by uvicorn after vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s).
"""

import asyncio
import json
import os

MAX_BODY_ENV = "METAL_CLUSTER_MAX_REQUEST_BODY_BYTES"
MAX_WAITING_ENV = "METAL_CLUSTER_MAX_WAITING_REQUESTS"
BODY_TIMEOUT_ENV = "METAL_CLUSTER_REQUEST_BODY_TIMEOUT"
DEFAULT_MAX_BODY = 8 * 2**20
DEFAULT_MAX_WAITING = 512
DEFAULT_BODY_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


async def _send_error(send, status: int, message: str, kind: str, headers=()) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive, limit: int, timeout_s: float) -> list[dict]:
    """The request's body messages, raising _TooLarge as soon as they pass `limit` bytes and
    _TooSlow when the whole body has not arrived within `timeout_s`."""
    messages, size = [], 0
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
        except TimeoutError:
            raise _TooSlow from None
        messages.append(message)
        if message["type"] != "http.request":
            return messages  # the client went away: the app sees that as it would have
        size += len(message.get("body", b""))
        if size > limit:
            raise _TooLarge
        if not message.get("more_body"):
            return messages


class Admission:
    def __init__(self, app):
        self.app = app
        self.max_body = int(os.environ.get(MAX_BODY_ENV, DEFAULT_MAX_BODY))
        self.max_waiting = int(os.environ.get(MAX_WAITING_ENV, DEFAULT_MAX_WAITING))
        self.body_timeout_s = float(os.environ.get(BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S))
        self.in_flight = 0  # admitted POST /v1/* requests not answered yet, streams included

    def _capacity(self, scope) -> int:
        config = getattr(scope["app"].state, "vllm_config", None) if "app" in scope else None
        running = config.scheduler_config.max_num_seqs if config is not None else 0
        return running + self.max_waiting

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            return await self._too_large(send)
        capacity = self._capacity(scope)
        if self.in_flight >= capacity:
            return await _send_error(
                send, 503, f"the server is full: {capacity} requests running or waiting (--max-num-seqs plus "
                           f"--max-waiting-requests); retry after {RETRY_AFTER_S}s", "ServiceUnavailable",
                headers=[(b"retry-after", str(RETRY_AFTER_S).encode())])
        self.in_flight += 1
        try:
            try:
                messages = await _read_body(receive, self.max_body, self.body_timeout_s)
            except _TooLarge:  # a chunked body has no length to check up front
                return await self._too_large(send)
            except _TooSlow:
                return await _send_error(send, 408, f"the request body did not arrive within {self.body_timeout_s:g}s "
                                                    f"(--request-body-timeout)", "RequestTimeout",
                                         headers=[(b"connection", b"close")])

            async def replay():
                return messages.pop(0) if messages else await receive()

            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1

    async def _too_large(self, send):
        await _send_error(send, 413, f"the request body is larger than {self.max_body} bytes "
                                     f"(--max-request-body-bytes)", "RequestTooLarge")
