"""`duplex chat` with a reasoning model: the thinking goes to stderr (dimmed on a terminal, on
lines of its own), the answer alone to stdout, as a pipe needs it."""
from __future__ import annotations

import io

from duplex.frontend.chat import Chat, Conversation
from duplex.frontend.protocol import WsDelta, WsDone, WsTimings, WsUsage


class FramesSocket:
    """The socket `Chat` reads: answers each request with the frames given."""

    def __init__(self, frames) -> None:
        self.frames = list(frames)
        self.sent: list[dict] = []

    def send(self, frame: dict) -> None:
        self.sent.append(frame)

    def receive(self, timeout=None):
        return self.frames.pop(0)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def frames():
    usage = WsUsage(5, 6, 11, 0, {}, reasoning_tokens=3)
    return [WsDelta("1", "", 1, reasoning="Two and"), WsDelta("1", "", 1, reasoning=" two."),
            WsDelta("1", "Fo", 1), WsDelta("1", "ur.", 1),
            WsDone("1", "stop", usage, WsTimings(0.1, 10.0, 0.2), False)]


def chat_with(out, err) -> Chat:
    return Chat(FramesSocket(frames()), Conversation(None, {}), out=out, err=err,
                interactive=False, show_stats=False, reconnect_s=0.0)


def test_piped_the_answer_alone_goes_to_stdout():
    out, err = io.StringIO(), io.StringIO()
    answer = chat_with(out, err).ask("2+2?")
    assert out.getvalue() == "Four.\n"
    assert err.getvalue() == "Two and two.\n"
    assert answer.text == "Four."


def test_on_a_terminal_the_thinking_is_dimmed_and_apart():
    out, err = io.StringIO(), Tty()
    chat_with(out, err).ask("2+2?")
    assert err.getvalue() == "\x1b[2mTwo and\x1b[0m\x1b[2m two.\x1b[0m\n\n"
    assert out.getvalue() == "Four.\n"
