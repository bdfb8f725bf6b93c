"""`duplex chat`: a terminal chat client over the WebSocket API (GET /v1/ws).

Owns one conversation (system prompt, turns, sampling overrides) and one socket. The socket
lives on an asyncio loop in a daemon thread that puts decoded frames on a queue; the main
thread reads the keyboard and prints. SIGINT always lands in the main thread, so Ctrl-C
while an answer streams becomes a `cancel` frame and the program goes on, while Ctrl-C (or
Ctrl-D) at the prompt ends it.

    stdin is a terminal                      stdin is not (a pipe, a file)
    ---------------------------------------  ---------------------------------------------
    prompt, streamed answer, stats line       all of stdin is one user message; only the
    /help /reset /system /params /quit        answer goes to stdout, the stats line to stderr

Failures are one line on stderr, never a traceback. When the socket drops, the client
reconnects (for up to --reconnect-timeout seconds) and sends the request again, unless part
of the answer already went down a pipe. A reasoning model's thinking goes to stderr, dimmed
on a terminal and apart from the answer, never to stdout. Exit status: 0 done, 1 failed,
2 usage error, 130 interrupted (piped mode). Imports msgspec, aiohttp and the protocol
structs, never torch.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import queue
import sys
import threading
import time
from typing import NamedTuple, TextIO

import aiohttp
import msgspec

from duplex.frontend.errors import from_validation
from duplex.frontend.protocol import (SamplingFields, WsDelta, WsDone, WsError, WsPong, WsServerFrame,
                               ws_json_schema)

DEFAULT_URL = "ws://127.0.0.1:8000/v1/ws"
API_KEY_ENV = "DUPLEX_API_KEY"
URL_ENV = "DUPLEX_URL"  # as the examples read it
HEARTBEAT_S = 15.0  # a server that stops answering pings is noticed within about this long
CONNECT_TIMEOUT_S = 10.0
CANCEL_WAIT_S = 5.0  # after a cancel, how long to wait for the request's terminal frame
MAX_ATTEMPTS = 3  # sends of one request (the first one and its retries)
RETRY_PAUSE_S = 1.0
RETRY_CODES = frozenset({"unavailable", "overloaded"})  # error frames worth sending again
SAMPLING_NAMES = SamplingFields.__struct_fields__
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

HELP = """\
Enter sends. End a line with \\ to continue on the next one, or put \"\"\" alone on a line
to start and end a multi-line block.
  /reset                          forget the conversation (the system prompt stays)
  /system TEXT                    set the system prompt (/system alone removes it)
  /params NAME=VALUE ...          set sampling fields, e.g. temperature=0.7 max_tokens=200;
                                  NAME=none returns to the server's default; /params shows them
  /help                           this text
  /quit                           leave (so do Ctrl-D and Ctrl-C at the prompt)
Ctrl-C while an answer streams cancels it."""


# ================================================================ arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get(URL_ENV) or DEFAULT_URL,
                        help="WebSocket URL of the server; http:// URLs and a bare HOST:PORT "
                             f"are accepted too (default: ${URL_ENV}, else {DEFAULT_URL})")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"API key, sent as a Bearer token (default: ${API_KEY_ENV})")
    parser.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: the server's)")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="longest answer in tokens (default: up to the context length)")
    parser.add_argument("--reconnect-timeout", type=float, default=30.0, metavar="S",
                        help="after the connection drops, how long to keep reconnecting")
    parser.add_argument("--no-stats", action="store_true",
                        help="do not print the stats line after each answer")
    parser.add_argument("--print-schema", action="store_true",
                        help="print the JSON Schema of the WebSocket frames and exit")


def schema_text() -> str:
    """docs/ws-schema.json: the JSON Schema of every frame, generated from the protocol."""
    return json.dumps(ws_json_schema(), indent=2) + "\n"


def ws_url(url: str) -> str:
    """The socket URL from what the user typed: ws(s)://, http(s):// or HOST:PORT."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "ws", url
    scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    if scheme not in ("ws", "wss") or not rest.strip("/"):
        raise ValueError(f"not a WebSocket URL: {url!r} (expected e.g. {DEFAULT_URL})")
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host}/{path if path else 'v1/ws'}"


def parse_params(words: list[str], current: dict) -> dict:
    """`temperature=0.7 max_tokens=none ...` applied to `current`; ValueError says what is
    wrong. Values are JSON where they parse (numbers, lists, true), text otherwise."""
    params = dict(current)
    for word in words:
        name, sep, value = word.partition("=")
        if not sep or name not in SAMPLING_NAMES:
            raise ValueError(f"expected NAME=VALUE, NAME one of: {', '.join(SAMPLING_NAMES)}")
        if value.lower() in ("", "none", "null", "default"):
            params.pop(name, None)
            continue
        try:
            params[name] = msgspec.json.decode(value)
        except msgspec.DecodeError:
            params[name] = value
    try:
        msgspec.convert(params, SamplingFields)
    except msgspec.ValidationError as e:
        raise ValueError(from_validation(e).message) from None
    return params


# ================================================================ the socket
class ChatError(Exception):
    """A failure told in one line. `lost`: the socket is gone. `retryable`: the same request
    (or connection) may succeed later. `fatal`: the program cannot go on."""

    def __init__(self, message: str, *, lost: bool = False, retryable: bool = False,
                 fatal: bool = False) -> None:
        super().__init__(message)
        self.lost, self.retryable, self.fatal = lost, retryable, fatal


class Closed(NamedTuple):
    """The last item on a socket's frame queue: why the socket ended."""
    reason: str


class Socket:
    """One WebSocket to the server, driven by an asyncio loop on a daemon thread.

    Frames arrive decoded (protocol structs) on a queue the main thread reads with
    `receive`; the socket's end arrives there as `Closed`. `connect` may be called again
    after a loss; it starts a fresh queue, so nothing of the old socket leaks into it."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="duplex-chat-socket")
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._frames: queue.Queue = queue.Queue()

    @property
    def is_open(self) -> bool:
        return self._ws is not None and not self._ws.closed

    def connect(self) -> None:
        self._call(self._connect(), CONNECT_TIMEOUT_S + 2)

    def send(self, frame: dict) -> None:
        self._call(self._send(msgspec.json.encode(frame).decode()), CONNECT_TIMEOUT_S)

    def receive(self, timeout: float | None = None):
        """The next server frame; ChatError(lost) once the socket ended; queue.Empty when
        `timeout` passes first."""
        item = self._frames.get(timeout=timeout)
        if isinstance(item, Closed):
            self._frames.put(item)  # it stays ended for later calls
            raise ChatError(item.reason, lost=True, retryable=True)
        return item

    def close(self) -> None:
        try:
            self._call(self._close(), 3)
        except (ChatError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(3)

    def _call(self, coro, timeout_s: float):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ChatError(f"no answer from {self.url} within {timeout_s:.0f} s",
                            lost=True, retryable=True) from None

    # ------------------------------------------------------------ on the socket's loop
    async def _connect(self) -> None:
        await self._close()
        self._session = aiohttp.ClientSession()
        try:
            self._ws = await self._session.ws_connect(
                self.url, headers=self._headers, heartbeat=HEARTBEAT_S, max_msg_size=0)
        except BaseException as e:
            await self._close()
            raise _connect_error(self.url, e) from None
        self._frames = queue.Queue()
        self._loop.create_task(self._read(self._ws, self._frames))

    async def _read(self, ws: aiohttp.ClientWebSocketResponse, frames: queue.Queue) -> None:
        decoder = msgspec.json.Decoder(WsServerFrame)
        reason = None
        async for message in ws:
            if message.type == aiohttp.WSMsgType.ERROR:
                break
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            try:
                frames.put(decoder.decode(message.data))
            except msgspec.DecodeError as e:  # (ValidationError included)
                reason = f"the server sent a frame this client does not understand: {e}"
                await ws.close()
                break
        frames.put(Closed(reason or _close_reason(ws)))

    async def _send(self, text: str) -> None:
        if not self.is_open:
            raise ChatError("the connection to the server was lost", lost=True, retryable=True)
        try:
            await self._ws.send_str(text)
        except (ConnectionError, aiohttp.ClientError) as e:
            raise ChatError(f"the connection to the server was lost ({e})", lost=True,
                            retryable=True) from None

    async def _close(self) -> None:
        ws, session, self._ws, self._session = self._ws, self._session, None, None
        if ws is not None:
            await ws.close()
        if session is not None:
            await session.close()


def _connect_error(url: str, e: BaseException) -> BaseException:
    """A failed connect -> ChatError in one line (a cancellation passes through)."""
    if isinstance(e, aiohttp.WSServerHandshakeError):
        if e.status in (401, 403):
            return ChatError(f"the server at {url} rejected the API key (HTTP {e.status}); "
                             f"pass --api-key KEY or set {API_KEY_ENV}", fatal=True)
        if e.status in (429, 503):
            return ChatError(f"the server at {url} is not ready (HTTP {e.status})", lost=True,
                             retryable=True)
        return ChatError(f"no Duplex WebSocket API at {url} (HTTP {e.status}; the path is "
                         "/v1/ws)", fatal=True)
    if isinstance(e, aiohttp.ClientConnectorError):
        errno = e.os_error.errno
        why = os.strerror(errno).lower() if errno else str(e.os_error)
        return ChatError(f"cannot connect to {url}: {why} (is `duplex serve` running?)",
                         lost=True, retryable=True)
    if isinstance(e, (aiohttp.InvalidURL, ValueError)):
        return ChatError(f"not a valid URL: {url}", fatal=True)
    if isinstance(e, (aiohttp.ClientError, OSError, asyncio.TimeoutError)):
        return ChatError(f"cannot connect to {url}: {e or type(e).__name__}", lost=True,
                         retryable=True)
    return e


def _close_reason(ws: aiohttp.ClientWebSocketResponse) -> str:
    if ws.close_code == 1001:
        return "the server is shutting down"
    if ws.close_code == 1009:
        return "the server refused a frame as too large"
    if isinstance(ws.exception(), asyncio.TimeoutError):
        return f"the server stopped answering (no pong within {HEARTBEAT_S:.0f} s)"
    return "the connection to the server was lost"


# ================================================================ one conversation
class Conversation:
    """The turns so far, the system prompt and the client's sampling overrides. Only a
    finished answer becomes a turn; a cancelled or failed one leaves no trace."""

    def __init__(self, system: str | None, params: dict) -> None:
        self.system = system
        self.params = params
        self.turns: list[dict] = []
        self._num_requests = 0

    def request(self, user_text: str) -> dict:
        """A `chat` frame for the next answer; its id is new on this client."""
        self._num_requests += 1
        system = [{"role": "system", "content": self.system}] if self.system else []
        messages = system + self.turns + [{"role": "user", "content": user_text}]
        return {"type": "chat", "id": str(self._num_requests), "messages": messages,
                **self.params}

    def add_turn(self, user_text: str, answer_text: str) -> None:
        self.turns += [{"role": "user", "content": user_text},
                       {"role": "assistant", "content": answer_text}]

    def reset(self) -> None:
        self.turns = []


class Answer(NamedTuple):
    text: str
    done: WsDone
    num_draft_proposed: int
    num_draft_accepted: int


def stats_line(answer: Answer) -> str:
    usage, timings = answer.done.usage, answer.done.timings
    parts = [f"ttft {timings.ttft_s * 1000:.0f} ms", f"{timings.tokens_per_s:.1f} tokens/s",
             f"{usage.completion_tokens} tokens",
             f"{usage.cached_tokens}/{usage.prompt_tokens} prompt tokens cached"]
    proposed, accepted = answer.num_draft_proposed, answer.num_draft_accepted
    parts.append(f"draft {accepted}/{proposed} accepted ({accepted / proposed:.0%})"
                 if proposed else "no speculation")
    if answer.done.finish_reason != "stop":
        parts.append(f"finish: {answer.done.finish_reason}")
    return "[" + ", ".join(parts) + "]"


class Chat:
    """Sends the conversation's requests on the socket and streams the answers to `out`;
    notes (stats, cancels, retries) go to `err`."""

    def __init__(self, socket: Socket, conversation: Conversation, *, out: TextIO, err: TextIO,
                 interactive: bool, show_stats: bool, reconnect_s: float) -> None:
        self.socket = socket
        self.conversation = conversation
        self.out, self.err = out, err
        self.interactive = interactive
        self.show_stats = show_stats
        self.reconnect_s = reconnect_s
        self._wrote = False  # part of the current answer is on `out`
        self._is_line_open = False  # `out` does not end with a newline
        self._is_thinking = False  # reasoning is being written to `err`, its line open

    def ask(self, user_text: str) -> Answer | None:
        """One turn: the finished answer (now part of the conversation) or None when the
        user cancelled it. Raises ChatError when it failed."""
        request = self.conversation.request(user_text)
        self._wrote = False
        answer = self._send_with_retries(request)
        if answer is not None:
            self.conversation.add_turn(user_text, answer.text)
            if self.show_stats:
                self.note(stats_line(answer), dim=True)
        return answer

    def reconnect(self) -> None:
        """Reopen the socket, trying for up to `reconnect_s`; ChatError(fatal) if it cannot."""
        deadline = time.monotonic() + self.reconnect_s
        pause = 0.25
        while True:
            try:
                self.socket.connect()
                return
            except ChatError as e:
                if not e.retryable:
                    raise ChatError(str(e), fatal=True) from None
                if time.monotonic() + pause > deadline:
                    raise ChatError(f"{e}; gave up reconnecting after {self.reconnect_s:g} s",
                                    fatal=True) from None
            time.sleep(pause)
            pause = min(2 * pause, 2.0)

    def note(self, text: str, dim: bool = False) -> None:
        if dim and self.interactive and self.err.isatty():
            text = f"\x1b[2m{text}\x1b[0m"
        self.err.write(text + "\n")
        self.err.flush()

    def _send_with_retries(self, request: dict) -> Answer | None:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return self._stream(request)
            except ChatError as e:
                self._end_line()
                if (not e.retryable or attempt == MAX_ATTEMPTS
                        or (self._wrote and not self.interactive)):
                    raise
                self.note(f"{e}; retrying ({attempt}/{MAX_ATTEMPTS - 1})")
                if e.lost:
                    self.reconnect()
                else:
                    time.sleep(RETRY_PAUSE_S * attempt)
        raise AssertionError("unreachable")

    def _stream(self, request: dict) -> Answer | None:
        """Send one request and write its answer as it arrives; Ctrl-C cancels it."""
        texts: list[str] = []
        num_proposed = num_accepted = 0
        try:
            self.socket.send(request)
            while True:
                frame = self.socket.receive()
                if isinstance(frame, WsPong) or frame.id not in (request["id"], None):
                    continue  # a frame of an earlier, abandoned request
                if isinstance(frame, WsDelta):
                    self._think(frame.reasoning)
                    if frame.text:
                        self._end_thinking()
                    self._write(frame.text)
                    texts.append(frame.text)
                    num_proposed += frame.draft_proposed
                    num_accepted += frame.draft_accepted
                elif isinstance(frame, WsDone):
                    self._end_thinking()
                    self._end_line()
                    return Answer("".join(texts), frame, num_proposed, num_accepted)
                else:
                    raise _request_error(frame)
        except KeyboardInterrupt:
            self._end_thinking()
            self._end_line()
            self._cancel(request["id"])
            return None

    def _cancel(self, request_id: str) -> None:
        """After Ctrl-C: send `cancel`, then drop frames until the request's terminal frame
        (a second Ctrl-C, or a silent server, stops the wait; the next request has a new id)."""
        self.note("[cancelled]", dim=True)
        try:
            self.socket.send({"type": "cancel", "id": request_id})
            deadline = time.monotonic() + CANCEL_WAIT_S
            while (left := deadline - time.monotonic()) > 0:
                frame = self.socket.receive(timeout=left)
                if isinstance(frame, (WsDone, WsError)) and frame.id == request_id:
                    return
        except (ChatError, queue.Empty, KeyboardInterrupt):
            pass

    def _think(self, text: str) -> None:
        """Reasoning goes to `err` (never `out`, so a pipe gets the answer alone), dimmed on
        a terminal, on lines of its own before the answer."""
        if not text:
            return
        if self.err.isatty():
            text = f"\x1b[2m{text}\x1b[0m"
        self.err.write(text)
        self.err.flush()
        self._is_thinking = True

    def _end_thinking(self) -> None:
        if self._is_thinking:
            self._is_thinking = False
            self.err.write("\n\n" if self.err.isatty() else "\n")
            self.err.flush()

    def _write(self, text: str) -> None:
        if not text:
            return
        self.out.write(text)
        self.out.flush()
        self._wrote = True
        self._is_line_open = not text.endswith("\n")

    def _end_line(self) -> None:
        """End the answer's last line, so what follows starts on a line of its own."""
        if self._is_line_open:
            self._write("\n")


def _request_error(frame: WsError) -> ChatError:
    return ChatError(f"the server answered with an error ({frame.code}): {frame.message}",
                     retryable=frame.code in RETRY_CODES)


# ================================================================ the two modes
def read_message(read_line=input) -> str:
    """One user message from the terminal: a line, lines continued by a trailing \\, or a
    block between two lines that are exactly \"\"\"."""
    line = read_line(">>> ")
    if line.strip() == '"""':
        lines = []
        while (line := read_line("... ")).strip() != '"""':
            lines.append(line)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_line("... ")
    return "\n".join(lines + [line])


def run_command(line: str, chat: Chat) -> bool:
    """Carry out a /command; True when it asks to leave."""
    name, _, rest = line.strip().partition(" ")
    conversation = chat.conversation
    if name in ("/quit", "/exit"):
        return True
    if name == "/reset":
        conversation.reset()
        chat.note("(conversation cleared)")
    elif name == "/system":
        conversation.system = rest.strip() or None
        chat.note(f"(system prompt: {conversation.system!r})")
    elif name == "/params":
        try:
            conversation.params = parse_params(rest.split(), conversation.params)
        except ValueError as e:
            chat.note(f"/params: {e}")
        shown = json.dumps(conversation.params) if conversation.params else "server defaults"
        chat.note(f"(params: {shown})")
    elif name == "/help":
        chat.note(HELP)
    else:
        chat.note(f"unknown command {name}; /help lists the commands")
    return False


def run_interactive(chat: Chat) -> int:
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    chat.note(f"Connected to {chat.socket.url}. /help lists commands; Ctrl-D quits.")
    while True:
        try:
            text = read_message()
        except (EOFError, KeyboardInterrupt):
            chat.out.write("\n")
            return EXIT_OK
        if text.startswith("/"):
            if run_command(text, chat):
                return EXIT_OK
            continue
        if not text.strip():
            continue
        try:
            if not chat.socket.is_open:
                chat.note("reconnecting...")
                chat.reconnect()
            chat.ask(text)
        except KeyboardInterrupt:  # during a reconnect or a retry's pause
            chat.note("[cancelled]", dim=True)
        except ChatError as e:
            chat.note(f"duplex chat: {e}")
            if e.fatal:
                return EXIT_FAILED


def run_piped(chat: Chat, prompt: str) -> int:
    try:
        answer = chat.ask(prompt)
    except ChatError as e:
        chat.note(f"duplex chat: {e}")
        return EXIT_FAILED
    return EXIT_OK if answer is not None else EXIT_INTERRUPTED


def run(args: argparse.Namespace) -> int:
    if args.print_schema:
        sys.stdout.write(schema_text())
        return EXIT_OK
    try:
        url = ws_url(args.url)
        given = {"temperature": args.temperature, "max_tokens": args.max_tokens}
        params = parse_params([], {k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        print(f"duplex chat: {e}", file=sys.stderr)
        return EXIT_USAGE
    interactive = sys.stdin.isatty()
    try:
        prompt = None if interactive else sys.stdin.read().rstrip()  # echo's newline too
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if prompt is not None and not prompt.strip():
        print("duplex chat: stdin is empty; pipe a prompt in, e.g. "
              "echo 'Hello' | duplex chat", file=sys.stderr)
        return EXIT_USAGE
    socket = Socket(url, args.api_key or os.environ.get(API_KEY_ENV))
    chat = Chat(socket, Conversation(args.system, params), out=sys.stdout, err=sys.stderr,
                interactive=interactive, show_stats=not args.no_stats,
                reconnect_s=args.reconnect_timeout)
    try:
        socket.connect()
        return run_interactive(chat) if interactive else run_piped(chat, prompt)
    except ChatError as e:
        print(f"duplex chat: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of stdout went away (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    finally:
        socket.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duplex chat", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
