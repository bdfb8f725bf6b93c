"""Generated documents equal what their generators produce now, and the hand-written
WebSocket guide names every frame field and error code the protocol has."""
from __future__ import annotations

import re
import subprocess
import sys

import msgspec
from client_support import REPO, client_env

from duplex.frontend import protocol
from duplex.frontend.chat import schema_text
from duplex.frontend.cli import SUBCOMMANDS

DOCS = REPO / "docs"
FRAMES = (protocol.WsChat, protocol.WsCancel, protocol.WsPing, protocol.WsDelta,
          protocol.WsDone, protocol.WsError, protocol.WsPong, protocol.WsUsage,
          protocol.WsTimings)
# Error codes a WebSocket error frame can carry: ws.py's own, plus the ApiError kinds that
# admission, validation, the pipeline and deadlines raise.
ERROR_CODES = {"invalid_request", "cancelled", "overloaded", "unavailable", "timeout",
               "internal"}


def test_ws_schema_file_is_regenerated():
    assert (DOCS / "ws-schema.json").read_text() == schema_text(), (
        "docs/ws-schema.json is stale: duplex chat --print-schema > docs/ws-schema.json")


def test_print_schema_flag_prints_the_file():
    result = subprocess.run([sys.executable, "-m", "duplex.frontend.chat", "--print-schema"],
                            capture_output=True, text=True, cwd=REPO, env=client_env(),
                            check=True)
    assert result.stdout == (DOCS / "ws-schema.json").read_text()


def test_cli_reference_is_regenerated():
    result = subprocess.run([sys.executable, "-m", "duplex.frontend.cli_docs", "--check"],
                            capture_output=True, text=True, cwd=REPO, env=client_env())
    assert result.returncode == 0, result.stderr
    text = (DOCS / "cli-reference.md").read_text()
    for name in SUBCOMMANDS:
        assert f"\n## `duplex {name}`\n" in text
    assert "| `--reconnect-timeout S` | `30.0` |" in text


def test_websocket_guide_names_every_field_and_code():
    guide = (DOCS / "websocket.md").read_text()
    for frame in FRAMES:
        tag = frame.__struct_config__.tag
        if isinstance(tag, str):
            assert f'`"{tag}"`' in guide, tag
        for field in frame.__struct_fields__:
            assert f"| `{field}` |" in guide, f"{frame.__name__}.{field} is not documented"
    for role in msgspec.inspect.type_info(protocol.ChatMessage).fields[0].type.values:
        assert f"`{role}`" in guide
    codes_section = guide.split("\n## Error codes\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", codes_section, re.M))
    assert documented == ERROR_CODES
    ws_source = (REPO / "frontend" / "ws.py").read_text()
    assert set(re.findall(r'WsError\([^,]+, "(\w+)"', ws_source)) <= ERROR_CODES
