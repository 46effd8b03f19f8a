"""libGenie's GeniePipeline / GenieNode C API through ctypes: nodes made from their configs,
wired into a pipeline, data set on a node's IO, the text-generator's tokens and an encoder's
embeddings handed back through callbacks (the model class that drives it: pipelinemodel.py).

The C API is read from QAIRT's GenieNode.h / GeniePipeline.h (Genie 1.21's signatures); the IO
values past the public header's are measured on this libGenie (docs/genie-pipelines.md).
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable

import numpy as np

from . import libgenie as genie

# GenieNode_IOName_t. 0-205: QAIRT's GenieNode.h; the rest measured on libGenie 1.21 (x86):
# TOKEN_INPUT is the one 1..3 setData takes token ids on, TOKEN_OUTPUT the one
# GenieNode_setTokenCallback accepts, AUDIO_* what an audio-encoder node takes data on (700
# input_features, 702 padded_mask_after_cnn, 704 input_features_mask) and gives its embeddings
# out of (701), WILDCARD the value GeniePipeline_connect checks (1000); names past the header ours
IO = {
    "GENIE_NODE_TEXT_GENERATOR_TEXT_INPUT": 0,
    "GENIE_NODE_TEXT_GENERATOR_EMBEDDING_INPUT": 1,
    "GENIE_NODE_TEXT_GENERATOR_TEXT_OUTPUT": 2,
    "GENIE_NODE_TEXT_GENERATOR_TOKEN_INPUT": 3,
    "GENIE_NODE_TEXT_GENERATOR_TOKEN_OUTPUT": 4,
    "GENIE_NODE_TEXT_ENCODER_TEXT_INPUT": 100,
    "GENIE_NODE_TEXT_ENCODER_EMBEDDING_OUTPUT": 101,
    "GENIE_NODE_IMAGE_ENCODER_IMAGE_INPUT": 200,
    "GENIE_NODE_IMAGE_ENCODER_EMBEDDING_OUTPUT": 201,
    "GENIE_NODE_IMAGE_ENCODER_IMAGE_POS_SIN": 202,
    "GENIE_NODE_IMAGE_ENCODER_IMAGE_POS_COS": 203,
    "GENIE_NODE_IMAGE_ENCODER_IMAGE_FULL_ATTN_MASK": 204,
    "GENIE_NODE_IMAGE_ENCODER_IMAGE_WINDOW_ATTN_MASK": 205,
    "GENIE_NODE_AUDIO_ENCODER_AUDIO_INPUT": 700,
    "GENIE_NODE_AUDIO_ENCODER_EMBEDDING_OUTPUT": 701,
    "GENIE_NODE_AUDIO_ENCODER_MASK_AFTER_CNN_INPUT": 702,
    "GENIE_NODE_AUDIO_ENCODER_MASK_INPUT": 704,
    "GENIE_NODE_WILDCARD": 1000,
}

_h = ctypes.c_void_p
# void (*)(const uint32_t* dims, uint32_t rank, size_t bytes, const void* buffer, const void* user)
EMBEDDING_CB = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32,
                                ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
# the text-generator's tokens: as GenieDialog_TokenQueryCallback_t (ids, count, sentence code, user)
TOKEN_CB = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_int,
                            ctypes.c_void_p)


def load() -> ctypes.CDLL:
    """runtime/genie/libgenie.py's libGenie, with the pipeline and node functions typed (again on each
    call: setting a function's argtypes is idempotent and cheap, and no flag needs keeping)."""
    lib = genie.load()
    p, i32 = ctypes.POINTER, ctypes.c_int32
    sigs = {
        "GenieNodeConfig_createFromJson": ([ctypes.c_char_p, p(_h)], i32),
        "GenieNodeConfig_bindLogger": ([_h, _h], i32),
        "GenieNodeConfig_free": ([_h], i32),
        "GenieNode_create": ([_h, p(_h)], i32),
        "GenieNode_free": ([_h], i32),
        "GenieNode_setData": ([_h, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                               ctypes.c_char_p], i32),
        "GenieNode_setEmbeddingCallback": ([_h, ctypes.c_int, EMBEDDING_CB], i32),
        "GenieNode_setTokenCallback": ([_h, ctypes.c_int, TOKEN_CB], i32),
        "GeniePipelineConfig_createFromJson": ([ctypes.c_char_p, p(_h)], i32),
        "GeniePipelineConfig_bindLogger": ([_h, _h], i32),
        "GeniePipelineConfig_free": ([_h], i32),
        "GeniePipeline_create": ([_h, p(_h)], i32),
        "GeniePipeline_addNode": ([_h, _h], i32),
        "GeniePipeline_connect": ([_h, _h, ctypes.c_int, _h, ctypes.c_int], i32),
        "GeniePipeline_execute": ([_h, ctypes.c_void_p], i32),
        "GeniePipeline_reset": ([_h], i32),
        "GeniePipeline_free": ([_h], i32),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def _check(status: int, what: str, log: genie.GenieLog) -> None:
    if status < 0:
        raise genie.GenieError(what, status, log.tail())


class Node:
    """One GenieNode made from its config dict (``{"text-generator": {...}}``, ...)."""

    def __init__(self, config: dict, log: genie.GenieLog):
        lib = load()
        self.role = next(iter(config))
        self.log = log
        self._cfg, self.handle = _h(), _h()
        try:
            _check(lib.GenieNodeConfig_createFromJson(json.dumps(config).encode(),
                                                      ctypes.byref(self._cfg)),
                   f"GenieNodeConfig_createFromJson ({self.role})", log)
            _check(lib.GenieNodeConfig_bindLogger(self._cfg, log.handle),
                   "GenieNodeConfig_bindLogger", log)
            _check(lib.GenieNode_create(self._cfg, ctypes.byref(self.handle)),
                   f"GenieNode_create ({self.role})", log)
        except genie.GenieError:
            self.close()
            raise

    def set_text(self, io: str, text: str) -> None:
        """A text piece on node IO ``io`` (a NUL-terminated string, as Genie reads it)."""
        data = text.encode() + b"\0"
        buf = ctypes.create_string_buffer(data, len(data))
        _check(load().GenieNode_setData(self.handle, IO[io], buf, len(data), None),
               f"GenieNode_setData ({self.role}, {io})", self.log)

    def set_data(self, io: str, data: np.ndarray) -> None:
        """The array on node IO ``io`` (Genie reads the bytes while the call runs)."""
        data = np.ascontiguousarray(data)
        _check(load().GenieNode_setData(self.handle, IO[io], data.ctypes.data, data.nbytes, None),
               f"GenieNode_setData ({self.role}, {io})", self.log)

    def close(self) -> None:
        lib = load()
        if self.handle:
            lib.GenieNode_free(self.handle)
            self.handle = _h()
        if self._cfg:
            lib.GenieNodeConfig_free(self._cfg)
            self._cfg = _h()


class Pipeline:
    """A GeniePipeline over ``nodes`` (by genie_pipeline.json key), wired as ``connections``
    ([producer, producer IO, consumer, consumer IO] each); the text-generator's tokens go to
    ``on_token`` as its callback hands them over, ``embeddings_from`` (node, output IO) to
    ``rows`` as [rows, width] float32 (an encoder node whose rows the host passes on)."""

    def __init__(self, nodes: dict[str, Node], connections: list[list[str]],
                 log: genie.GenieLog, embeddings_from: tuple[str, str] | None = None):
        lib = load()
        self.nodes, self.log = nodes, log
        self._cfg, self.handle = _h(), _h()
        self.on_token: Callable[[int], None] = lambda t: None
        self.rows: list[np.ndarray] = []
        # referenced for as long as Genie may call them
        self._token_cb, self._emb_cb = TOKEN_CB(self._tokens), EMBEDDING_CB(self._embeddings)
        try:
            _check(lib.GeniePipelineConfig_createFromJson(b"{}", ctypes.byref(self._cfg)),
                   "GeniePipelineConfig_createFromJson", log)
            _check(lib.GeniePipelineConfig_bindLogger(self._cfg, log.handle),
                   "GeniePipelineConfig_bindLogger", log)
            _check(lib.GeniePipeline_create(self._cfg, ctypes.byref(self.handle)),
                   "GeniePipeline_create", log)
            for node in nodes.values():
                _check(lib.GeniePipeline_addNode(self.handle, node.handle),
                       f"GeniePipeline_addNode ({node.role})", log)
            for prod, prod_io, cons, cons_io in connections:
                _check(lib.GeniePipeline_connect(self.handle, nodes[prod].handle, IO[prod_io],
                                                 nodes[cons].handle, IO[cons_io]),
                       f"GeniePipeline_connect ({prod} {prod_io} -> {cons} {cons_io})", log)
            if "textGenerator" in nodes:
                _check(lib.GenieNode_setTokenCallback(nodes["textGenerator"].handle,
                                                      IO["GENIE_NODE_TEXT_GENERATOR_TOKEN_OUTPUT"],
                                                      self._token_cb),
                       "GenieNode_setTokenCallback", log)
            if embeddings_from is not None:
                name, io = embeddings_from
                _check(lib.GenieNode_setEmbeddingCallback(nodes[name].handle, IO[io],
                                                          self._emb_cb),
                       f"GenieNode_setEmbeddingCallback ({name})", log)
        except genie.GenieError:
            self.close()
            raise

    def _tokens(self, ptr, n, _code, _user) -> None:
        for i in range(n):
            self.on_token(int(ptr[i]))

    def _embeddings(self, dims, rank, size, buffer, _user) -> None:
        shape = [int(dims[i]) for i in range(rank)]
        flat = np.ctypeslib.as_array(ctypes.cast(buffer, ctypes.POINTER(ctypes.c_float)),
                                     shape=(size // 4,)) if size else np.zeros(0, np.float32)
        self.rows.append(flat.reshape(-1, shape[-1]).copy())

    def execute(self) -> int:
        status = load().GeniePipeline_execute(self.handle, None)
        _check(status, "GeniePipeline_execute", self.log)
        return status

    def reset(self) -> None:
        _check(load().GeniePipeline_reset(self.handle), "GeniePipeline_reset", self.log)

    def close(self) -> None:
        lib = load()
        if self.handle:
            lib.GeniePipeline_free(self.handle)
            self.handle = _h()
        if self._cfg:
            lib.GeniePipelineConfig_free(self._cfg)
            self._cfg = _h()
