"""Every message that crosses a process boundary, as msgspec structs (no pickle anywhere).

Frontend -> worker: AddRequest, AbortRequests, Shutdown.
Worker -> frontend: Ready, Heartbeat (its typed stats: engine/stats.py), Outputs (a batch of
    RequestDelta), WorkerError, HandoffFailed.
Prefill worker -> decode worker (KV hand-off, see engine/kv_transfer.py): KvOffer, KvBlocks
    (+ one raw frame per block), KvDone, KvCancel.
Decode worker -> prefill worker: KvNeed, KvAck, KvReject.

Each struct is tagged (``tag=...``) so one ``decode`` call tells the types apart; a frame
that does not decode into exactly one of these types is rejected by the receiver and
logged. KV tensors never travel inside these structs: they ride as raw extra frames.
"""
from __future__ import annotations

import enum

import msgspec

from duplex.engine.sampling_params import SamplingParams
from duplex.engine.stats import WorkerStats  # noqa: F401 - a wire type too (Heartbeat.stats)

_WIRE = dict(frozen=True, array_like=True, omit_defaults=True, gc=False)

# Upper bound on one frame from the network; larger frames are rejected before decoding.
MAX_FRAME_BYTES = 64 * 1024 * 1024


# ---------------------------------------------------------------- frontend -> worker
class AddRequest(msgspec.Struct, tag="add", **_WIRE):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str = ""  # hex of the tenant salt (kvstore.keys.tenant_salt), made server-side
    retention: str = "chat"  # "chat" | "agent": which TTL class its KV blocks get
    deadline: float = 0.0  # absolute time.time() after which the worker aborts it; 0 = none
    # Tokens already generated for it elsewhere (a prefill worker's first token, or the tokens
    # a client has seen when a stream resumes on another worker): the engine continues after
    # them and counts them against max_tokens.
    output_token_ids: list[int] = []
    # Prefill/decode split: the decode worker that continues after the first token, and the
    # address where it takes KV blocks. Empty: this worker runs the request to its end.
    handoff_to: str = ""
    handoff_address: str = ""


class AbortRequests(msgspec.Struct, tag="abort", **_WIRE):
    req_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", **_WIRE):
    drain_timeout_s: float = 0.0


# ---------------------------------------------------------------- worker -> frontend
class FinishReason(enum.StrEnum):
    """Why a choice ended. The values are the strings the OpenAI APIs and the WebSocket emit
    (Anthropic maps them to its own stop reasons); a str, so it compares equal to them."""
    STOP = "stop"              # a stop token or stop string: the answer is complete
    LENGTH = "length"          # max_tokens (or the context) ran out
    TOOL_CALLS = "tool_calls"  # a STOP after tool calls (set by the frontend, never a worker)
    ABORT = "abort"            # cancelled: client gone, server shutdown, worker deadline
    ERROR = "error"            # the engine or a worker failed
    TIMEOUT = "timeout"        # the frontend's deadline passed (set by the frontend)


# The finish reasons of a choice that ended without an answer (RequestDelta.error says why).
FAILURES = frozenset({FinishReason.ABORT, FinishReason.ERROR, FinishReason.TIMEOUT})


class TokenLogprob(msgspec.Struct, **_WIRE):
    """Logprob of the sampled token and its top alternatives (token id, logprob)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class RequestDelta(msgspec.Struct, **_WIRE):
    """What one request produced in one engine step."""
    req_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] = []
    finish_reason: FinishReason | None = None  # STOP | LENGTH | ABORT | ERROR from a worker
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = {}  # "device" | "host" | "disk" | "shared" -> tokens
    num_draft_proposed: int = 0  # in this delta
    num_draft_accepted: int = 0
    accepted_draft_mask: list[bool] = []  # per new token: came from an accepted draft
    error: str = ""
    queue_s: float = 0.0  # arrival (AddRequest.arrival_time) -> first scheduled; 0: not yet
    error_kind: str = ""  # INVALID: the request itself is bad and can never run (no retry)


INVALID = "invalid"  # RequestDelta.error_kind of a request a worker refuses as invalid


class Outputs(msgspec.Struct, tag="outputs", **_WIRE):
    worker_id: str
    deltas: list[RequestDelta]


class Ready(msgspec.Struct, tag="ready", **_WIRE):
    worker_id: str
    role: str  # "unified" | "prefill" | "decode"
    model_name: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    batch_invariant: bool = False
    speculation: str = "off"
    pid: int = 0
    kv_address: str = ""  # decode workers: where prefill workers send KV blocks
    # What the KV block keys are made of (kvstore.keys.namespace), so the router can compute
    # the same keys as the workers for prefix affinity.
    model_identity: str = ""
    kv_dtype: str = ""
    kv_layout: str = ""
    num_threads: int = 0  # torch threads of the worker's steps
    weights: str = ""  # weight precision in use: float32, bfloat16, or the quantization
    kv_shared: str = ""  # identity of the fleet-shared KV store it uses (kvstore.shared), or ""


class Heartbeat(msgspec.Struct, tag="heartbeat", **_WIRE):
    worker_id: str
    stats: WorkerStats
    time: float = 0.0
    pid: int = 0  # the sender's process (its Ready's pid); 0: unknown


class WorkerError(msgspec.Struct, tag="error", **_WIRE):
    """The worker hit an unrecoverable error; every in-flight request is lost."""
    worker_id: str
    message: str


class HandoffFailed(msgspec.Struct, tag="handoff_failed", **_WIRE):
    """A prefill worker could not hand a request's KV to its decode worker (unreachable,
    refused, or no acknowledgement within the lease). It released the blocks; the frontend
    decides: recompute on a decode worker, or fail the request."""
    worker_id: str
    req_id: str
    decode_worker_id: str
    reason: str


# ---------------------------------------------------------------- prefill -> decode (KV)
class KvOffer(msgspec.Struct, tag="kv_offer", **_WIRE):
    """Sent when a prefill worker admits a request: what the decode worker will continue
    (`request` carries no tokens beyond the prompt yet) and the keys of the prompt's full
    blocks. The decode worker derives the keys itself and answers KvNeed or KvReject."""
    req_id: str
    request: AddRequest
    keys: list[bytes]
    dtype: str
    block_shape: list[int]  # one block of every layer: [layers, 2, block_size, heads, dim]


class KvBlocks(msgspec.Struct, tag="kv_blocks", **_WIRE):
    """Header of a group of blocks; raw frame i holds block indices[i] (keys[i]): exactly
    the bytes of `shape` in `dtype`, C order."""
    req_id: str
    indices: list[int]
    keys: list[bytes]
    dtype: str
    shape: list[int]
    num_tokens: int  # tokens per block


class KvDone(msgspec.Struct, tag="kv_done", **_WIRE):
    """Every block the decode worker asked for was sent; `first_token_ids` are the tokens
    the prefill worker generated (the decode worker continues after them)."""
    req_id: str
    first_token_ids: list[int]
    num_blocks_sent: int


class KvCancel(msgspec.Struct, tag="kv_cancel", **_WIRE):
    req_id: str
    reason: str = ""


# ---------------------------------------------------------------- decode -> prefill (KV)
class KvNeed(msgspec.Struct, tag="kv_need", **_WIRE):
    """Block indices the decode worker lacks (it already holds the others by key)."""
    req_id: str
    indices: list[int]


class KvAck(msgspec.Struct, tag="kv_ack", **_WIRE):
    """The request runs on the decode worker now: the prefill worker may free its blocks."""
    req_id: str


class KvReject(msgspec.Struct, tag="kv_reject", **_WIRE):
    req_id: str
    reason: str


ToWorker = AddRequest | AbortRequests | Shutdown
FromWorker = Outputs | Ready | Heartbeat | WorkerError | HandoffFailed
ToDecodeKV = KvOffer | KvBlocks | KvDone | KvCancel
FromDecodeKV = KvNeed | KvAck | KvReject

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)
_to_decode_kv = msgspec.msgpack.Decoder(ToDecodeKV)
_from_decode_kv = msgspec.msgpack.Decoder(FromDecodeKV)


class BadFrame(ValueError):
    """A frame that is not one of our messages: oversized, garbled or of an unknown type."""


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_worker(frame: bytes) -> ToWorker:
    return _decode(_to_worker, frame)


def decode_from_worker(frame: bytes) -> FromWorker:
    return _decode(_from_worker, frame)


def decode_to_decode_kv(frame: bytes) -> ToDecodeKV:
    return _decode(_to_decode_kv, frame)


def decode_from_decode_kv(frame: bytes) -> FromDecodeKV:
    return _decode(_from_decode_kv, frame)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes):
    if len(frame) > MAX_FRAME_BYTES:
        raise BadFrame(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise BadFrame(f"undecodable frame ({len(frame)} bytes): {e}") from None
