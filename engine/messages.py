"""Every message that crosses a process boundary, as msgspec structs (no pickle anywhere).

Frontend -> worker: AddRequest, AbortRequests, Shutdown.
Worker -> frontend: Ready, Heartbeat, Outputs (a batch of RequestDelta), WorkerError.

Each struct is tagged (``tag=...``) so one ``decode`` call tells the types apart; a frame
that does not decode into exactly one of these types is rejected by the receiver and
logged. KV tensors never travel inside these structs: they ride as raw extra frames.
"""
from __future__ import annotations

import msgspec

from engine.sampling_params import SamplingParams

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


class AbortRequests(msgspec.Struct, tag="abort", **_WIRE):
    req_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", **_WIRE):
    drain_timeout_s: float = 0.0


# ---------------------------------------------------------------- worker -> frontend
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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = {}  # "device" | "host" | "disk" -> tokens
    num_draft_proposed: int = 0  # in this delta
    num_draft_accepted: int = 0
    accepted_draft_mask: list[bool] = []  # per new token: came from an accepted draft
    error: str = ""


class Outputs(msgspec.Struct, tag="outputs", **_WIRE):
    worker_id: str
    deltas: list[RequestDelta]


class WorkerStats(msgspec.Struct, **_WIRE):
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    extra: dict[str, float] = {}  # tier bytes, hit rates, cost-model coefficients, ...


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


class Heartbeat(msgspec.Struct, tag="heartbeat", **_WIRE):
    worker_id: str
    stats: WorkerStats
    time: float = 0.0


class WorkerError(msgspec.Struct, tag="error", **_WIRE):
    """The worker hit an unrecoverable error; every in-flight request is lost."""
    worker_id: str
    message: str


ToWorker = AddRequest | AbortRequests | Shutdown
FromWorker = Outputs | Ready | Heartbeat | WorkerError

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


class BadFrame(ValueError):
    """A frame that is not one of our messages: oversized, garbled or of an unknown type."""


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_worker(frame: bytes) -> ToWorker:
    return _decode(_to_worker, frame)


def decode_from_worker(frame: bytes) -> FromWorker:
    return _decode(_from_worker, frame)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes):
    if len(frame) > MAX_FRAME_BYTES:
        raise BadFrame(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise BadFrame(f"undecodable frame ({len(frame)} bytes): {e}") from None
