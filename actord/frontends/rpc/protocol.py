"""JSON-RPC 2.0 framing, to the letter: one JSON value per line, decoded with msgspec at the edge.

What the specification asks, and where it is done here:

- A request is an object with `"jsonrpc": "2.0"` and a string `method`; `id`, when present,
  is a string, an integer or null (a boolean, a fraction, an object is refused as an
  Invalid Request). `params`, when present, is an object or an array (actord's methods take
  named params: an empty array is read as no params, any other array is Invalid params).
- A request without `id` is a notification: it is run, and nothing is ever sent back for
  it, not even an error.
- A batch is an array of requests: each is run (concurrently), and one array of the
  responses comes back, notifications left out; nothing at all when every element was a
  notification; an empty array is one Invalid Request error.
- Text that is not JSON is a Parse error (-32700) with id null, and so is JSON nested too
  deep to decode (msgspec raises RecursionError: that is a property of the input, not a
  bug in the daemon). JSON that is not a request is an Invalid Request (-32600) with the id
  recovered when it is a valid one, else null.
- Every error object's `data.type` names its type (ParseError, InvalidRequest,
  MethodNotFound, InvalidParams or an `actord.vocabulary.errors` class).

`params` stays `msgspec.Raw` until the method is known, then decodes straight into that
method's typed params Struct.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from actord.vocabulary.errors import ActordError, INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR

MAX_LINE = 64 << 20  # what a *client* accepts as one response line (the daemon's own bound is Config)

Id = int | str | None


class Request(msgspec.Struct):
    jsonrpc: Literal["2.0"]
    method: str
    id: Id | msgspec.UnsetType = msgspec.UNSET
    params: msgspec.Raw = msgspec.Raw(b"{}")

    @property
    def is_notification(self) -> bool:
        return self.id is msgspec.UNSET

    @property
    def rid(self) -> Id:
        return None if self.id is msgspec.UNSET else self.id


class ErrorObj(msgspec.Struct, omit_defaults=True):
    code: int
    message: str
    data: dict[str, Any] | None = None


class Response(msgspec.Struct, omit_defaults=False):
    id: Id
    jsonrpc: str = "2.0"
    result: Any = None


class ErrorResponse(msgspec.Struct):
    id: Id
    error: ErrorObj
    jsonrpc: str = "2.0"


class Notification(msgspec.Struct):
    method: str
    params: Any
    jsonrpc: str = "2.0"


class _IdOnly(msgspec.Struct):
    id: Id | msgspec.UnsetType = msgspec.UNSET


encoder = msgspec.json.Encoder(enc_hook=str)  # a Path or other odd value in error data is text, not a crash
request_decoder = msgspec.json.Decoder(Request)
batch_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_id_decoder = msgspec.json.Decoder(_IdOnly)
_any_decoder = msgspec.json.Decoder()


class ProtocolError(Exception):
    def __init__(self, code: int, message: str, id: Id = None, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.id, self.data = code, message, id, data


def parse_error(detail: str) -> ProtocolError:
    return ProtocolError(PARSE_ERROR, f"parse error: {detail}")


def is_batch(line: bytes) -> bool:
    return line.lstrip()[:1] == b"["


def decode_batch(line: bytes) -> list[msgspec.Raw]:
    """The elements of a batch line, or a Parse error."""
    try:
        return batch_decoder.decode(line)
    except msgspec.DecodeError as e:
        raise parse_error(str(e)) from None
    except RecursionError:
        raise parse_error("nested too deep") from None


def decode_request(data: bytes | msgspec.Raw) -> Request:
    """One request object, or a ProtocolError that says whether and with which id to answer."""
    try:
        req = request_decoder.decode(data)
    except msgspec.ValidationError as e:
        # Valid JSON but not a request, or not JSON at all past the point msgspec stopped:
        # decode it whole to tell the two apart and to recover a valid id.
        try:
            obj = _any_decoder.decode(data)
        except msgspec.DecodeError as e2:
            raise parse_error(str(e2)) from None
        except RecursionError:
            raise parse_error("nested too deep") from None
        raise ProtocolError(INVALID_REQUEST, f"invalid request: {e}", _valid_id(obj)) from None
    except msgspec.DecodeError as e:
        raise parse_error(str(e)) from None
    except RecursionError:
        raise parse_error("nested too deep") from None
    head = bytes(memoryview(req.params)[:1]) if len(req.params) else b""
    if head not in (b"{", b"["):
        raise ProtocolError(INVALID_REQUEST, "invalid request: params must be an object or an array", req.rid)
    return req


def peek_id(line: bytes) -> tuple[bool, Id]:
    """(answer?, id) for a line refused before it is decoded: notifications get nothing."""
    if is_batch(line):
        return True, None
    try:
        got = _id_decoder.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return True, None
    if got.id is msgspec.UNSET:
        return False, None
    return True, got.id


def _valid_id(obj: Any) -> Id:
    if isinstance(obj, dict):
        rid = obj.get("id")
        if isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool)):
            return rid
    return None


def error_obj(err: BaseException) -> ErrorObj:
    if isinstance(err, ProtocolError):
        return ErrorObj(code=err.code, message=err.message, data=err.data or {"type": _std_type(err.code)})
    if isinstance(err, ActordError):
        return ErrorObj(code=err.code, message=err.message, data=err.to_dict())
    return ErrorObj(code=INTERNAL_ERROR, message=f"internal error: {type(err).__name__}",
                    data={"type": "InternalError"})


def error_response(id: Id, err: BaseException, *, newline: bool = True) -> bytes:
    out = encoder.encode(ErrorResponse(id=id, error=error_obj(err)))
    return out + b"\n" if newline else out


def _std_type(code: int) -> str:
    return {
        PARSE_ERROR: "ParseError", INVALID_REQUEST: "InvalidRequest",
        METHOD_NOT_FOUND: "MethodNotFound", INVALID_PARAMS: "InvalidParams",
    }.get(code, "InternalError")


def result_response(id: Id, result: Any, *, newline: bool = True) -> bytes:
    out = encoder.encode(Response(id=id, result=result))
    return out + b"\n" if newline else out


def notification(method: str, params: Any) -> bytes:
    return encoder.encode(Notification(method=method, params=params)) + b"\n"


def batch_response(parts: list[bytes]) -> bytes:
    return b"[" + b",".join(parts) + b"]\n"
