"""``hexforge serve BUNDLE``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

    GET  /v1/models             the one bundle
    POST /v1/chat/completions   messages -> the checkpoint's chat template -> generation
    POST /v1/completions        a plain prompt
    stream: true -> server-sent events (``data: {chunk}`` ... ``data: [DONE]``)

Concurrency: one engine per bundle (its state buffers are the model's memory), so requests queue
on a lock and run one at a time, each in a worker thread; the event loop stays free to accept,
stream and notice disconnects. A watcher polls each request's connection every 50 ms; a client that
disconnects sets its request's cancel flag, which the token loop polls every token (and a request
still queued skips its turn): the generation stops and the next request gets the engine.

``response_format``: json_schema / json_object (and hexforge's regex / lark) constrain the output
with llguidance (runtime/constrain.py); every finished output parses, finish_reason "length" says
it was cut by max_tokens.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with 400 for bad
requests (context overflow: code ``context_length_exceeded``), 401 for a wrong API key, and 404
``model_not_found`` for a ``model`` that is not the one served — as OpenAI's API answers an
unknown model, not a silent answer from another model (llama.cpp's server ignores the field; a
client asking for "gpt-4" here should learn it is not talking to gpt-4). A request without a
``model`` gets the bundle's.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..bundle.errors import ContextOverflowError, HexforgeError, RequestError
from ..runtime.options import Done, GenerationOptions, GenerationResult, Piece
from ..runtime.text import check_messages


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, lt=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    response_format: dict | None = None
    ignore_eos: bool = False  # as vLLM's extension: run to max_tokens (benchmarks, tests)
    prompt_lookup: int | None = Field(default=None, ge=1)  # speculative decoding's draft tokens

    def generation_kwargs(self) -> dict:
        kw: dict[str, Any] = {"max_new_tokens": self.max_tokens, "temperature": self.temperature,
                              "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                              "stop": self.stop}
        if self.min_p is not None:
            kw["min_p"] = self.min_p
        if self.repetition_penalty is not None:
            kw["repetition_penalty"] = self.repetition_penalty
        if self.ignore_eos:
            kw["ignore_eos"] = True
        if self.prompt_lookup is not None:
            kw["prompt_lookup"] = self.prompt_lookup
        if self.response_format is not None:
            kw["response_format"] = self.response_format  # compiled in respond(), off the loop
        return kw


class ChatRequest(_Request):
    messages: list[dict]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)


MAX_MEDIA_BYTES = 32 * 1024 * 1024  # one image / audio clip in a request, decoded from base64


def _b64(data: Any, what: str) -> bytes:
    import base64
    import binascii

    if not isinstance(data, str) or len(data) > MAX_MEDIA_BYTES * 4 // 3 + 4:
        raise RequestError(f"{what}: expected base64 data of at most {MAX_MEDIA_BYTES} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{what}: not valid base64") from None


def media_of(part: dict, kind: str) -> bytes:
    """OpenAI content parts -> file bytes: image_url {"url": "data:image/...;base64,..."} and
    input_audio {"data": base64, "format": "wav"}. Remote URLs are refused: no fetching."""
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
            raise RequestError("image_url must be a data URL (data:image/png;base64,...); this "
                               "server does not fetch remote images")
        return _b64(url.partition(";base64,")[2], "image_url")
    ref = part.get("input_audio")
    return _b64(ref.get("data") if isinstance(ref, dict) else None, "input_audio")


def text_of(content: Any, placeholders: dict[str, str] | None = None,
            media: dict[str, list[bytes]] | None = None) -> str:
    """A message's content: a string, or OpenAI content parts. Image / audio parts become the
    bundle's placeholder text (``placeholders``: modality -> text) and their bytes go to
    ``media`` (modality -> list), in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                out.append(str(part.get("text", "")))
            elif kind in ("image_url", "input_audio"):
                modality = "image" if kind == "image_url" else "audio"
                if not placeholders or modality not in placeholders or media is None:
                    raise RequestError(f"this bundle has no {modality} encoder: send text only")
                media.setdefault(modality, []).append(media_of(part, kind))
                out.append(placeholders[modality])
            else:
                raise RequestError(f"unknown message content part {kind!r}")
        return "".join(out)
    raise RequestError("message content must be a string or a list of parts")


async def watch_disconnect(request: Request, cancel: threading.Event, every_s: float = 0.05) -> None:
    """Sets ``cancel`` when the client goes away. Polled on a timer, not between tokens: a fast
    token stream must not hide a disconnect, and a request still queued for the lock has none."""
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(every_s)


def _error(status: int, message: str, code: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": kind, "param": None, "code": code}})


def _typed_error(e: HexforgeError) -> JSONResponse:
    """A typed error -> its own status (RequestError 400, BackendError 500, ...)."""
    return _error(e.http_status, str(e), kind="invalid_request_error" if e.http_status < 500
                  else "server_error")


def _usage(result: GenerationResult) -> dict:
    n = len(result.token_ids)
    out: dict[str, Any] = {"prompt_tokens": result.prompt_tokens, "completion_tokens": n,
                           "total_tokens": result.prompt_tokens + n}
    if result.speculation is not None:  # under prompt_lookup: drafted / accepted tokens
        out["speculation"] = result.speculation
    return out


def _finish(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def create_app(model, model_id: str, api_key: str | None = None) -> FastAPI:
    """The OpenAI routes over one loaded model, served as ``model_id``; ``api_key``: the bearer
    token every request must carry (None: none)."""
    app = FastAPI(title="hexforge", version="1")
    _handle_errors(app, api_key)
    api = _Api(model, model_id)
    app.get("/v1/models")(api.models)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/v1/completions")(api.completions)
    return app


def _handle_errors(app: FastAPI, api_key: str | None) -> None:
    """Every error OpenAI-shaped: typed errors with their status, validation 400, a bug 500, a
    wrong API key 401."""

    @app.exception_handler(HexforgeError)
    async def _typed(_req, exc):
        return _typed_error(exc)

    @app.exception_handler(Exception)
    async def _bug(_req, exc):  # a bug, not the client's fault: still an OpenAI-shaped body
        return _error(500, f"internal error: {type(exc).__name__}", kind="server_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, exc):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", [])[1:])
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(401, "invalid or missing API key", "invalid_api_key",
                          "authentication_error")
        return await call_next(request)


class _Reply:
    """One response's identity and body shapes: a whole completion or its stream's chunks."""

    def __init__(self, model_id: str, chat: bool):
        self.model_id, self.chat = model_id, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def chunk(self, piece: str | None, reason: str | None, extra: dict | None = None,
              role: bool = False) -> str:
        """One server-sent event of the stream."""
        if self.chat:
            delta = {"role": "assistant"} if role else {} if piece is None else {"content": piece}
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": reason}
        body = {"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                "created": self.created, "model": self.model_id, "choices": [choice],
                **(extra or {})}
        return f"data: {json.dumps(body)}\n\n"

    def body(self, result: GenerationResult, logprobs: list[dict] | None) -> dict:
        """The whole completion (``logprobs``: per token {token, logprob, top_logprobs})."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": result.text},
                                      "finish_reason": _finish(result)}
            if logprobs is not None:
                choice["logprobs"] = {"content": logprobs}
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": _finish(result)}
            if logprobs is not None:
                choice["logprobs"] = {"tokens": [e["token"] for e in logprobs],
                                      "token_logprobs": [e["logprob"] for e in logprobs]}
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model_id, "choices": [choice], "usage": _usage(result)}


class _Api:
    """The routes of one served model: requests queue on one lock for its engine."""

    def __init__(self, model, model_id: str):
        self.model, self.model_id = model, model_id
        self.lock = threading.Lock()
        self.placeholders = {e.modality: e.placeholder_text for e in model.manifest.encoders}

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_id, "object": "model",
                                            "created": 0, "owned_by": "hexforge"}]}

    async def chat_completions(self, req: ChatRequest, request: Request):
        if (refused := self._unknown_model(req.model)) is not None:
            return refused
        model = self.model
        try:
            kw = req.generation_kwargs()
            kw["max_new_tokens"] = req.max_completion_tokens or req.max_tokens
            if req.logprobs:
                kw["logprobs"] = req.top_logprobs or 0
            check_messages(req.messages)  # a message without a role is a 400, not role "None"
            media: dict[str, list[bytes]] = {}
            messages = [{"role": str(m.get("role")),
                         "content": text_of(m.get("content"), self.placeholders, media)}
                        for m in req.messages]
            text = model.apply_chat_template(messages)
            ids = model.tokenizer.encode(text, add_special_tokens=False)
            # decoded now: bad media is a 400 before the response starts, not an error mid-stream
            decoded = model.decode_media(media.get("image"), media.get("audio"))
            kw.update({f"{m}s": items for m, (_, _, items) in decoded.items()})
        except HexforgeError as e:
            return _typed_error(e)
        return await self._respond(request, ids, kw, chat=True, stream=req.stream)

    async def completions(self, req: CompletionRequest, request: Request):
        if (refused := self._unknown_model(req.model)) is not None:
            return refused
        try:
            kw = req.generation_kwargs()
            if req.logprobs is not None:
                kw["logprobs"] = req.logprobs
            ids = self.model.encode(req.prompt)
        except HexforgeError as e:
            return _typed_error(e)
        return await self._respond(request, ids, kw, chat=False, stream=req.stream)

    def _unknown_model(self, name: str | None) -> JSONResponse | None:
        """OpenAI's answer to a model it does not serve (None: the request named none)."""
        if name is None or name == self.model_id:
            return None
        return _error(404, f"The model `{name}` does not exist; this server serves "
                      f"`{self.model_id}` (GET /v1/models)", "model_not_found")

    async def _respond(self, request: Request, ids: list[int], kw: dict, chat: bool,
                       stream: bool):
        """The request's checks (context, its grammar), then its whole body or its stream."""
        model = self.model
        try:
            model.engine.check_request(ids, kw.get("max_new_tokens") or
                                       model.generation.max_new_tokens)
        except ContextOverflowError as e:
            return _error(400, str(e), "context_length_exceeded")
        except HexforgeError as e:
            return _typed_error(e)
        if kw.get("response_format") is not None:
            try:  # a big schema can take a while to compile: not on the event loop
                kw["constraint"] = await asyncio.to_thread(model.grammars.constraint,
                                                           kw.pop("response_format"))
            except HexforgeError as e:
                return _typed_error(e)
        reply = _Reply(self.model_id, chat)
        if stream:
            return StreamingResponse(self._events(reply, request, ids, kw),
                                     media_type="text/event-stream")
        result = None
        try:
            async for item in self._run(request, ids, kw):
                result = item.result if isinstance(item, Done) else result
        except HexforgeError as e:
            return _typed_error(e)
        if result is None:  # the client went away
            return _error(499, "client closed the request", "cancelled")
        return reply.body(result, None if result.logprobs is None else self._logprobs(result))

    async def _events(self, reply: _Reply, request: Request, ids: list[int], kw: dict):
        """The stream's server-sent events, ``data: [DONE]`` last."""
        if reply.chat:
            yield reply.chunk(None, None, role=True)
        try:
            async for item in self._run(request, ids, kw):
                if isinstance(item, Piece):
                    yield reply.chunk(item.text, None)
                else:
                    yield reply.chunk(None if reply.chat else "", _finish(item.result),
                                      {"usage": _usage(item.result)})
        except HexforgeError as e:
            body = {"error": {"message": str(e), "type": "invalid_request_error"}}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    def _logprobs(self, result: GenerationResult) -> list[dict]:
        tok = self.model.tokenizer
        return [{"token": tok.decode([e["token"]]), "logprob": e["logprob"],
                 "top_logprobs": [{"token": tok.decode([t]), "logprob": lp}
                                  for t, lp in e["top"]]} for e in result.logprobs or []]

    async def _run(self, request: Request, ids: list[int], kw: dict):
        """Async iterator over model.iterate's items, run in a worker thread under the lock."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the event loop has closed (server shutdown): nobody listens
                cancel.set()

        def worker():
            try:
                with self.lock:
                    if not cancel.is_set():  # its client may have left while it queued
                        options = GenerationOptions(should_stop=cancel.is_set, **kw)
                        for item in self.model.iterate(ids, options):
                            put(item)
            except BaseException as e:  # handed to the request
                put(e)
            put(None)

        threading.Thread(target=worker, daemon=True).start()
        watch = asyncio.create_task(watch_disconnect(request, cancel))
        try:
            while True:
                item = await items.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()  # disconnect / cancelled stream: stop the token loop (polled every token)
            watch.cancel()


def served_id(model, bundle: str | Path) -> str:
    """The ``model`` name a bundle is served as: <model_type>:<bundle folder>."""
    return model.manifest.model_type + ":" + Path(bundle).absolute().name


def serve(bundle: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          backend: str = "cpu", arch: str | None = None, model_name: str | None = None) -> None:
    """Load the bundle, bind the port (a port in use is the one-line OSError, before uvicorn
    starts), say where it listens, serve until Ctrl-C."""
    import uvicorn

    from ..runtime.model import load

    model = load(bundle, backend=backend, arch=arch)
    model_id = model_name or served_id(model, bundle)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = sock.getsockname()[1]  # --port 0: the one the system gave
    where = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"hexforge serve: {model_id} ({model.manifest.model_type}, backend {model.backend.name}, "
          f"target {model.target}) at http://{where}:{bound}/v1 — OpenAI API: /v1/chat/completions, "
          f"/v1/completions, /v1/models; model={model_id!r}"
          + ("; API key required" if api_key else "") + "; Ctrl-C stops", file=sys.stderr,
          flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(model, model_id, api_key),
                                           log_level="warning"))
    server.run(sockets=[sock])
