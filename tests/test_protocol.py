"""The control-socket wire format: frames, versions, limits, the command table."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chandrad import PROTOCOL_VERSION
from chandrad.errors import CONTROL_ERROR_CODES, ProtocolError
from chandrad.interfaces import DaemonControl
from chandrad.protocol import (
    COMMANDS,
    MAX_LINE_BYTES,
    decode_reply,
    decode_request,
    encode_error,
    encode_request,
    encode_result,
    validate_args,
)


def _code(line: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_request(line)
    return info.value.error_code


def test_request_round_trip() -> None:
    """An encoded request is one line and decodes to the same id, command and args."""
    line = encode_request("queue", {"state": "failed"}, id=7)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["v"] == PROTOCOL_VERSION
    req = decode_request(line)
    assert (req.id, req.cmd, req.args) == (7, "queue", {"state": "failed"})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)


@given(args=st.dictionaries(st.text(), json_values, max_size=5),
       rid=st.one_of(st.integers(), st.text()))
def test_round_trip_any_json_args(args: dict[str, Any], rid: int | str) -> None:
    """Any JSON args (unicode, newlines inside strings) survive a frame unchanged."""
    req = decode_request(encode_request("status", args, id=rid))
    assert (req.id, req.args) == (rid, args)


def test_not_json_is_bad_request() -> None:
    """A line that is not JSON is a bad_request, not a crash."""
    assert _code(b"hello daemon\n") == "bad_request"
    assert _code(b"\xff\xfe\n") == "bad_request"


def test_json_that_is_not_an_object_is_bad_request() -> None:
    """A JSON array or number is not a frame."""
    assert _code(b"[1, 2]\n") == "bad_request"
    assert _code(b"42\n") == "bad_request"


@pytest.mark.parametrize("line", [
    b'{"v": 1, "id": 1, "cmd": "status", "cmd": "drain"}\n',
    b'{"v": 1, "id": 1, "cmd": "cancel", "args": {"job": 1, "job": 2}}\n',
    b'{"v": 1, "v": 1, "id": 1, "cmd": "status"}\n',
    b'{"v": 1, "id": NaN, "cmd": "status"}\n',
    b'{"v": 1, "id": Infinity, "cmd": "status"}\n',
    b'{"v": 1, "id": 1, "cmd": "queue", "args": {"limit": -Infinity}}\n',
], ids=["cmd-twice", "arg-twice", "v-twice", "id-nan", "id-infinity", "arg-minus-infinity"])
def test_ambiguous_requests_are_bad_requests(line: bytes) -> None:
    """A key given twice (which one wins differs between parsers: Python's json took the
    last, so ``{"cmd": "status", "cmd": "drain"}`` drained) and NaN/Infinity (not JSON)
    are refused whole, whatever the rest of the request says."""
    with pytest.raises(ProtocolError) as info:
        decode_request(line)
    assert info.value.error_code == "bad_request"
    assert "ambiguous request" in info.value.message


def test_same_key_in_different_objects_is_fine() -> None:
    """Only a key repeated within one object is ambiguous."""
    req = decode_request(b'{"v": 1, "id": 1, "cmd": "retry", "args": {"v": 1, "id": 2}}\n')
    assert (req.cmd, req.args) == ("retry", {"v": 1, "id": 2})


def test_replies_may_carry_non_finite_metrics() -> None:
    """A reply is read as the daemon's json writes it: a NaN metric does not break status."""
    reply = decode_reply(encode_result(3, {"metrics": {"kv_cache": float("nan")}}))
    assert reply.ok and math.isnan(reply.result["metrics"]["kv_cache"])


def test_wrong_or_missing_version_keeps_the_id() -> None:
    """Version 2 or no version is unsupported_version, and the error still carries the id."""
    with pytest.raises(ProtocolError) as info:
        decode_request(b'{"v": 2, "id": "abc", "cmd": "status"}\n')
    assert info.value.error_code == "unsupported_version"
    assert info.value.request_id == "abc"
    assert _code(b'{"id": 1, "cmd": "status"}\n') == "unsupported_version"


def test_unknown_command() -> None:
    """A command outside the table is unknown_command, and the message lists the known ones."""
    with pytest.raises(ProtocolError) as info:
        decode_request(encode_request("shutdown", id=3))
    assert info.value.error_code == "unknown_command"
    assert "status" in info.value.message and info.value.request_id == 3


def test_args_must_be_an_object() -> None:
    """``args`` given as a list is a bad_request."""
    assert _code(b'{"v": 1, "id": 1, "cmd": "status", "args": [1]}\n') == "bad_request"


def test_oversized_line_is_too_large() -> None:
    """A line over the limit is refused before parsing, both ways."""
    big = b'{"v":1,"cmd":"status","args":{"x":"' + b"a" * MAX_LINE_BYTES + b'"}}\n'
    assert _code(big) == "too_large"
    with pytest.raises(ProtocolError) as info:
        encode_result(1, {"blob": "a" * MAX_LINE_BYTES})
    assert info.value.error_code == "too_large"


def test_result_carries_its_own_version() -> None:
    """The result object has ``"v"`` first, even if the daemon put a wrong one in."""
    reply = json.loads(encode_result(5, {"state": "running", "v": 99}))
    assert reply == {"v": 1, "id": 5, "ok": True, "result": {"v": 1, "state": "running"}}
    assert next(iter(reply["result"])) == "v"


def test_error_reply_and_decode() -> None:
    """An error reply decodes to its code and message; unknown codes become internal_error."""
    reply = decode_reply(encode_error(9, "not_found", "no job 9"))
    assert (reply.ok, reply.id, reply.error_code, reply.error_message) == (
        False, 9, "not_found", "no job 9")
    assert decode_reply(encode_error(1, "made_up", "x")).error_code == "internal_error"


def test_decode_reply_rejects_garbage_and_other_versions() -> None:
    """A reply that is neither ok nor a structured error, or of another version, is refused."""
    with pytest.raises(ProtocolError) as info:
        decode_reply(b'{"v": 1, "id": 1}\n')
    assert info.value.error_code == "bad_request"
    with pytest.raises(ProtocolError) as info:
        decode_reply(b'{"v": 2, "id": 1, "ok": true, "result": {}}\n')
    assert info.value.error_code == "unsupported_version"


def test_protocol_error_only_takes_known_codes() -> None:
    """ProtocolError refuses a code outside CONTROL_ERROR_CODES (typos fail loudly)."""
    with pytest.raises(ValueError):
        ProtocolError("forbiden", "typo")
    for code in CONTROL_ERROR_CODES:
        assert ProtocolError(code, "m").to_dict() == {"code": code, "message": "m"}


@pytest.mark.parametrize(("cmd", "args", "fragment"), [
    ("status", {"verbose": True}, "unknown argument 'verbose'"),
    ("cancel", {}, "'job' is required"),
    ("cancel", {"job": "3"}, "must be int"),
    ("cancel", {"job": True}, "must be int"),
    ("drain", {"wait": 1}, "must be bool"),
    ("queue", {"state": "exploded"}, "must be one of"),
])
def test_validate_args_rejects(cmd: str, args: dict[str, Any], fragment: str) -> None:
    """Bad arguments are a bad_request whose message names the argument."""
    with pytest.raises(ProtocolError) as info:
        validate_args(cmd, args)
    assert info.value.error_code == "bad_request"
    assert fragment in info.value.message


def test_validate_args_accepts_and_ignores_null_optionals() -> None:
    """Valid args pass unchanged; an optional argument given as null counts as absent."""
    assert validate_args("queue", {"state": "failed", "limit": 5}) == {
        "state": "failed", "limit": 5}
    assert validate_args("retry", {"job": None, "failed": True})


def test_command_table_matches_spec_and_daemon_interface() -> None:
    """Read tier is exactly status/queue/gpu/version; every command is a DaemonControl method."""
    read = {name for name, c in COMMANDS.items() if c.tier == "read"}
    assert read == {"status", "queue", "gpu", "version"}
    assert set(COMMANDS) - read == {
        "pause", "resume", "drain", "retry", "cancel", "reload", "engine_restart", "rescan"}
    for name in COMMANDS:
        assert callable(getattr(DaemonControl, name))
