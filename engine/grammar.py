"""Grammar-constrained decoding: compiled grammars, one matcher per request, token masks.

Owns, inside one worker: the grammar cache (compiled by xgrammar, keyed by a hash of the
constraint's kind and text, compiled in its own thread so neither the event loop nor the
step thread waits), the requests still waiting for their grammar, and each constrained
request's matcher. A request's output must match `SamplingParams.constraint`
(engine/sampling_params.py); the constraint travels as data and is compiled here, against
the model's own vocabulary.

Matchers follow the tokens the way KV follows them, by a counter:

    output_token_ids:  0 ........ num_accepted ............. num_output_tokens
                       | accepted by the matcher | appended since (caught up by `sync`)

so a prefill -> decode hand-off or a resume elsewhere (the new worker's AddRequest carries
the tokens generated before) rebuilds the matcher by replaying them, and preemption (the
tokens stay, only KV is recomputed) keeps it. Speculative drafts are walked through the
matcher and rolled back: a draft the grammar rejects is cut with everything after it, and
verification sees each draft row masked as the sampler would mask it, so greedy output is
the same with and without speculation.

Why xgrammar (llguidance is the other field library): on this CPU its masks cost ~5 us per
token at SmolLM2's 49k vocabulary against ~33 us for llguidance (median over a JSON-schema
walk, `docs/BENCHMARKS.md`), compiles a schema in ~15 ms, rolls a matcher back by token
count (`rollback(n)`), and parses schemas, regexes and EBNF without a tokenizer, which is
how the frontend refuses a bad one with a 400 before it reaches a worker.

After a thinking block (`Constraint.thinking`, set by the frontend where the request's output
is parsed for reasoning) the constraint holds for the answer only: the grammar compiled is a
structural tag whose first element is the block as free text up to its first `</think>`, then
a few blanks, then the constraint (`thinking_tag`). Why a structural tag and not a matcher
that stays off until the marker: the grammar walks the same bytes the reasoning parser reads,
so a `</think>` spelled by sub-tokens, or sharing a token with the text after it, ends the
block for both, where a token-id trigger would miss it; and the tokens a request brings (a
thinking-budget continuation's output ends with the closing text the frontend wrote, a resume
holds anything so far) are replayed through the one matcher like any others, so the block
ends wherever those tokens end it. A marker the grammar engine reads as a special token (no
text) is matched as that token instead. The control-byte bans below hold outside the block
only (`_Block`): tabs in the thinking are the model's business.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import msgspec
import numpy as np

from duplex.engine.sampling_params import Constraint
from duplex.engine.stats import GrammarStats
from duplex.engine.text.reasoning import END, START

if TYPE_CHECKING:  # torch is imported where a mask is made: the frontend parses constraints
    import torch  # with this module and holds no torch until xgrammar itself needs it

log = logging.getLogger("duplex.grammar")

MAX_SPEC_BYTES = 256 * 1024  # a schema / grammar / regex text longer than this is refused
MAX_CACHED = 256  # compiled grammars kept (LRU)
# json_object: any JSON object. Schemas are compiled without free whitespace between tokens
# (`any_whitespace=False`: ", " and ": " separators), or a small model can pad forever.
JSON_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A constraint the grammar engine cannot take; the message names what is wrong."""


class TokenMask(NamedTuple):
    """Which tokens rows of a logits batch may take: rows (ascending) and allowed
    [len(rows), vocab] bool."""
    rows: list[int]
    allowed: torch.Tensor


def constraint_key(constraint: Constraint) -> str:
    text = f"{constraint.kind}\0{constraint.spec}\0{constraint.thinking}"
    return hashlib.sha256(text.encode()).hexdigest()


def parse(constraint: Constraint):
    """The constraint as an xgrammar Grammar (no tokenizer needed); GrammarError when it is
    malformed or unsupported. Cheap: the frontend runs it to refuse bad input early."""
    import xgrammar as xgr

    if len(constraint.spec.encode()) > MAX_SPEC_BYTES:
        raise GrammarError(f"the {constraint.kind} is {len(constraint.spec.encode())} bytes; "
                           f"at most {MAX_SPEC_BYTES} are accepted")
    try:
        return _parse(xgr, constraint)
    except GrammarError:
        raise
    except Exception as error:  # xgrammar raises RuntimeError / ValueError subclasses
        raise GrammarError(f"invalid {constraint.kind}: {_first_line(error)}") from None


def _parse(xgr, constraint: Constraint):
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT, any_whitespace=False,
                                            strict_mode=False)
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "choice":
        return xgr.Grammar.from_structural_tag(choice_tag(json.loads(spec)))
    return xgr.Grammar.from_structural_tag(spec)


# Between `</think>` and a constrained answer (the models write "\n\n"; bounded, or a small
# model can pad forever)
BLANKS = {"type": "regex", "pattern": "[ \\n]{0,4}"}


def thinking_tag(constraint: Constraint, special: dict[str, int]) -> str:
    """The structural tag of a constraint that starts after a thinking block: the block as free
    text up to its first `</think>` (opened by `<think>` unless the prompt opened it; optional
    for "may_open"), up to four blanks, then the constraint. `special`: the markers the grammar
    engine reads only as special tokens (marker -> id), matched as those tokens."""
    import xgrammar as xgr

    content = ({"type": "any_tokens", "exclude_tokens": [special[END]]} if END in special
               else {"type": "any_text"})
    block = {"type": "tag", "begin": "" if constraint.thinking == "open" else
             _marker(START, special), "content": content, "end": _marker(END, special)}
    block = {"type": "sequence", "elements": [block, BLANKS]}
    if constraint.thinking == "may_open":
        block = {"type": "optional", "content": block}
    answer = _answer_format(xgr, msgspec.structs.replace(constraint, thinking=""))
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "sequence", "elements": [block, answer]}})


def _marker(text: str, special: dict[str, int]):
    return {"type": "token", "token": special[text]} if text in special else text


def _answer_format(xgr, constraint: Constraint) -> dict:
    """The constraint as one element of a structural tag: a tag's own format, else the
    grammar it parses to (as EBNF, so a JSON schema keeps its compact whitespace)."""
    if constraint.kind == "structural_tag":
        return json.loads(constraint.spec)["format"]
    if constraint.kind == "choice":
        return json.loads(choice_tag(json.loads(constraint.spec)))["format"]
    return {"type": "grammar", "grammar": str(_parse(xgr, constraint))}


def choice_tag(choices: list) -> str:
    """A structural tag whose output is exactly one of `choices` (non-empty strings)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("a choice constraint needs a non-empty list of non-empty strings")
    return json.dumps({"type": "structural_tag", "format": {
        "type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}})


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]


# JSON kinds are compiled without free whitespace, so a token holding a raw control byte
# (< 0x20) can never be part of valid output; xgrammar's rule for strings with a length
# bound (`[^"\\\r\n]{0,n}`) would let one through, so those tokens are banned as well.
# Structural tags (tool calls) hold JSON arguments too, and their literals may need a
# newline (Hermes' `<tool_call>\n`): there every control byte but "\n" is banned (free text
# before a call then writes no tabs).
JSON_KINDS = ("json_object", "json_schema")
TAG_KINDS = ("structural_tag",)


_BEFORE, _INSIDE, _AFTER = "before", "inside", "after"


class _Block:
    """Where an output stands with its thinking block (before it may open, inside, after),
    read from the bytes of its accepted tokens the way the grammar reads them."""

    def __init__(self, thinking: str, token_bytes: Callable[[int], bytes]) -> None:
        self.state = _INSIDE if thinking == "open" else _BEFORE
        self._token_bytes = token_bytes
        self._tail = b""  # bytes not yet known to hold no marker

    def push(self, token_id: int) -> None:
        if self.state == _AFTER:
            return
        self._tail += self._token_bytes(token_id)
        while self.state != _AFTER and self._step():
            pass

    def _step(self) -> bool:
        """Move past a marker in the tail; True when the state changed."""
        if self.state == _BEFORE:
            head = self._tail.lstrip()
            if head.startswith(START.encode()):
                self.state, self._tail = _INSIDE, head[len(START):]
                return True
            if not START.encode().startswith(head):
                self.state = _AFTER  # the answer began without a block
            return self.state == _AFTER
        at = self._tail.find(END.encode())
        if at >= 0:
            self.state, self._tail = _AFTER, b""
            return True
        self._tail = self._tail[-(len(END) - 1):]
        return False


class _Vocab:
    """The bytes of each token as the grammar engine reads them, and the think markers it
    reads only as special tokens (no text): those are matched, and read, as their ids."""

    def __init__(self, info, tokenizer) -> None:
        self._decoded = info.decoded_vocab  # token id -> bytes
        ids = tokenizer.get_vocab()
        special = set(info.special_token_ids)
        self.special_markers = {m: ids[m] for m in (START, END) if ids.get(m) in special}
        self._marker_of = {token_id: m for m, token_id in self.special_markers.items()}

    def token_bytes(self, token_id: int) -> bytes:
        marker = self._marker_of.get(token_id)
        if marker is not None:
            return marker.encode()
        return self._decoded[token_id] if token_id < len(self._decoded) else b""


class _Matcher:
    def __init__(self, matcher, banned: torch.Tensor | None, block: _Block | None) -> None:
        self.matcher = matcher
        self._banned = banned  # [vocab] bool: tokens masked out on top of the grammar
        self.block = block  # the thinking block before the constrained answer, if any
        self.num_accepted = 0  # leading output tokens the matcher has consumed

    @property
    def banned(self) -> torch.Tensor | None:
        """The ban now: none inside a thinking block (its text is free). Drafts are masked
        with the state after the last accepted token."""
        if self.block is not None and self.block.state == _INSIDE:
            return None
        return self._banned

    def accept(self, token_id: int) -> bool:
        if not self.matcher.accept_token(token_id):
            return False
        if self.block is not None:
            self.block.push(token_id)
        self.num_accepted += 1
        return True


class Grammars:
    """The worker's constrained-decoding state (EngineCore owns one).

    `tokenizer` is called once, in the compile thread, on the first constrained request:
    the model's Hugging Face tokenizer, whose vocabulary the grammars are compiled against.
    """

    def __init__(self, tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: Sequence[int], blocking: bool = False) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        # blocking: submit waits for the compile, so when a request is scheduled does not
        # depend on timing (expert-parallel ranks replay one schedule in lockstep)
        self.blocking = blocking
        self._lock = threading.Lock()  # compile times: appended in the compile thread
        self._compiler = None
        self._control_ids: torch.Tensor | None = None  # [vocab] bool, see JSON_KINDS
        self._vocab: _Vocab | None = None  # the tokens' bytes, as the grammar reads them
        self._tag_control_ids: torch.Tensor | None = None  # the same but "\n", TAG_KINDS
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiled: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._waiting: dict[str, tuple[object, Future]] = {}  # req_id -> (Request, Future)
        self._matchers: dict[str, _Matcher] = {}
        self._compile_times: collections.deque[float] = collections.deque(maxlen=1024)  # seconds
        self.mask_seconds = 0.0  # total time spent filling and unpacking masks
        self.num_masked_rows = 0

    @classmethod
    def for_model(cls, model_path: str, vocab_size: int, stop_token_ids: Sequence[int],
                  blocking: bool = False) -> Grammars:
        """Grammars compiled against the tokenizer of the model at model_path (a GGUF file's
        own vocabulary, or a Hugging Face directory's tokenizer), loaded on first use."""
        def tokenizer():
            # the text layer's loader (with its GGUF conversion cache); the engine has no
            # tokenizer of its own, and only constrained requests need one
            from duplex.engine.text.tokenizer import load_tokenizer

            return load_tokenizer(model_path)
        return cls(tokenizer, vocab_size, stop_token_ids, blocking)

    # ------------------------------------------------------------------ compile
    def submit(self, req) -> None:
        """Start (or reuse) the compile of req's grammar; req waits in here until then."""
        key = constraint_key(req.params.constraint)
        future = self._compiled.get(key)
        if future is None:
            future = self._executor.submit(self._compile, req.params.constraint)
            self._compiled[key] = future
            while len(self._compiled) > MAX_CACHED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        self._waiting[req.req_id] = (req, future)
        if self.blocking:
            concurrent.futures.wait([future])

    def take_ready(self) -> tuple[list, list[tuple[object, str]]]:
        """Requests whose grammar is compiled now (their matchers made and caught up with
        any tokens they bring), and (request, error) for those whose grammar failed."""
        ready, failed = [], []
        for req_id, (req, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[req_id]
            error = future.exception()
            if error is not None:
                self._compiled.pop(constraint_key(req.params.constraint), None)
                failed.append((req, _first_line(error)))
                continue
            self._matchers[req_id] = self._matcher(req.params.constraint, future.result())
            if self.sync(req):
                ready.append(req)
            else:
                failed.append((req, "the tokens generated before do not match the grammar"))
        return ready, failed

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def is_waiting(self, req_id: str) -> bool:
        return req_id in self._waiting

    def _matcher(self, constraint: Constraint, compiled) -> _Matcher:
        # after a thinking block the answer is held to the structural tag's ban ("\n" allowed:
        # the blanks after `</think>`; the JSON grammar itself allows no newline)
        kind = "structural_tag" if constraint.thinking else constraint.kind
        banned = self._control_ids if kind in JSON_KINDS else \
            self._tag_control_ids if kind in TAG_KINDS else None
        block = _Block(constraint.thinking, self._vocab.token_bytes) \
            if constraint.thinking else None
        return _Matcher(self._new_matcher(compiled), banned, block)

    def _compile(self, constraint: Constraint):
        start = time.perf_counter()
        compiler = self._get_compiler()
        kind, spec = constraint.kind, constraint.spec
        if constraint.thinking:
            compiled = compiler.compile_structural_tag(
                thinking_tag(constraint, self._vocab.special_markers))
        elif kind == "json_object":
            compiled = compiler.compile_json_schema(JSON_OBJECT, any_whitespace=False,
                                                    strict_mode=False)
        elif kind == "json_schema":
            compiled = compiler.compile_json_schema(spec, any_whitespace=False,
                                                    strict_mode=True)
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        elif kind == "grammar":
            compiled = compiler.compile_grammar(spec)
        elif kind == "choice":
            compiled = compiler.compile_structural_tag(choice_tag(json.loads(spec)))
        else:
            compiled = compiler.compile_structural_tag(spec)
        with self._lock:
            self._compile_times.append(time.perf_counter() - start)
        return compiled

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer = self._tokenizer()
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids or None)
            self._control_ids = _tokens_with(info, set(range(0x20)), self.vocab_size,
                                             self.stop_token_ids)
            self._tag_control_ids = _tokens_with(info, set(range(0x20)) - {0x0A},
                                                 self.vocab_size, self.stop_token_ids)
            self._vocab = _Vocab(info, tokenizer)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _new_matcher(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar 0.2

    # ------------------------------------------------------------------ tokens
    def has(self, req) -> bool:
        return req.req_id in self._matchers

    def sync(self, req) -> bool:
        """Feed the matcher the output tokens it has not seen; False if one is rejected."""
        state = self._matchers[req.req_id]
        tokens = req.output_token_ids
        while state.num_accepted < len(tokens):
            if not state.accept(tokens[state.num_accepted]):
                return False
        return True

    def is_terminated(self, req) -> bool:
        state = self._matchers.get(req.req_id)
        return state is not None and state.matcher.is_terminated()

    def masks(self, reqs: Sequence) -> TokenMask | None:
        """The allowed tokens of every constrained request among reqs (each caught up with
        its tokens first), for the sampler; None when none is constrained."""
        rows = [row for row, req in enumerate(reqs) if req.req_id in self._matchers]
        if not rows:
            return None
        start = time.perf_counter()
        bitmask = _bitmask(len(rows), self.vocab_size)
        for i, row in enumerate(rows):
            req = reqs[row]
            self.sync(req)
            self._matchers[req.req_id].matcher.fill_next_token_bitmask(bitmask, i)
        allowed = unpack(bitmask, self.vocab_size)
        for i, row in enumerate(rows):
            banned = self._matchers[reqs[row].req_id].banned
            if banned is not None:
                allowed[i] &= ~banned
        self._count(start, len(rows))
        return TokenMask(rows, allowed)

    def clip_drafts(self, reqs: Sequence) -> None:
        """Cut each constrained request's drafts at the first one its grammar rejects."""
        for req in reqs:
            if not req.spec_token_ids or req.req_id not in self._matchers:
                continue
            self.sync(req)
            state = self._matchers[req.req_id]
            matcher = state.matcher
            num_ok = 0
            for token_id in req.spec_token_ids:
                if state.banned is not None and state.banned[token_id]:
                    break
                if matcher.is_terminated() or not matcher.accept_token(token_id):
                    break
                num_ok += 1
            if num_ok:
                matcher.rollback(num_ok)
            req.keep_drafts(num_ok)

    def draft_masks(self, req) -> torch.Tensor:
        """Allowed tokens [k + 1, vocab] bool of a constrained request's verification rows:
        after its last token, then after each of its k drafts (all accepted by the
        grammar, see clip_drafts). The matcher ends where it started."""
        start = time.perf_counter()
        self.sync(req)
        matcher = self._matchers[req.req_id].matcher
        drafts = req.spec_token_ids
        bitmask = _bitmask(len(drafts) + 1, self.vocab_size)
        for i, token_id in enumerate(drafts):
            matcher.fill_next_token_bitmask(bitmask, i)
            accepted = matcher.accept_token(token_id)
            assert accepted, "clip_drafts keeps only drafts the grammar accepts"
        matcher.fill_next_token_bitmask(bitmask, len(drafts))
        if drafts:
            matcher.rollback(len(drafts))
        allowed = unpack(bitmask, self.vocab_size)
        banned = self._matchers[req.req_id].banned
        if banned is not None:
            allowed &= ~banned
        self._count(start, len(drafts) + 1)
        return allowed

    def _count(self, start: float, num_rows: int) -> None:
        self.mask_seconds += time.perf_counter() - start
        self.num_masked_rows += num_rows

    # ------------------------------------------------------------------ lifetime
    def free(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._waiting.pop(req_id, None)

    def stats(self) -> GrammarStats:
        with self._lock:
            times = sorted(self._compile_times)
        out = GrammarStats(mask_seconds=self.mask_seconds,
                           masked_rows=float(self.num_masked_rows),
                           waiting=float(len(self._waiting)), cached=float(len(self._compiled)))
        if not times:
            return out
        return msgspec.structs.replace(
            out, compile_p50_s=times[len(times) // 2],
            compile_p99_s=times[min(len(times) - 1, int(0.99 * len(times)))],
            compiles=float(len(times)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed bitmask [n, ceil(vocab / 32)] int32 (bit j of word w: token
    32 w + j, little-endian words) -> allowed [n, vocab_size] bool."""
    import torch

    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))


def _bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def _tokens_with(info, banned_bytes: set[int], vocab_size: int,
                 stop_token_ids: Sequence[int]) -> torch.Tensor:
    """[vocab] bool: tokens whose text holds one of banned_bytes (stop tokens never)."""
    import torch

    mask = torch.zeros(vocab_size, dtype=torch.bool)
    for token_id, text in enumerate(info.decoded_vocab[:vocab_size]):
        mask[token_id] = any(byte in banned_bytes for byte in text)
    mask[list(stop_token_ids)] = False
    return mask
