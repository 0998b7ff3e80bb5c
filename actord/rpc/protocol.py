"""JSON-RPC 2.0 framing: one JSON object per line, decoded with msgspec at the edge.

`params` stays `msgspec.Raw` until the method is known, then decodes straight into that
method's typed params Struct; a decode failure is an Invalid params error, never a crash.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.errors import (
    ActordError, INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR,
)

MAX_LINE = 64 << 20  # a 100k-token prompt as a token list is well under 1 MB

Id = int | str | None


class Request(msgspec.Struct, omit_defaults=True):
    method: str
    jsonrpc: str = "2.0"
    id: Id | msgspec.UnsetType = msgspec.UNSET
    params: msgspec.Raw = msgspec.Raw(b"{}")


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


encoder = msgspec.json.Encoder()
request_decoder = msgspec.json.Decoder(Request)
_any_decoder = msgspec.json.Decoder()


class ProtocolError(Exception):
    def __init__(self, code: int, message: str, id: Id = None, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.id, self.data = code, message, id, data


def decode_request(line: bytes) -> Request:
    try:
        return request_decoder.decode(line)
    except msgspec.ValidationError as e:
        # Valid JSON but not a request: recover the id if there is one.
        try:
            obj = _any_decoder.decode(line)
        except msgspec.DecodeError:
            obj = None
        rid = obj.get("id") if isinstance(obj, dict) and isinstance(obj.get("id"), (int, str)) else None
        raise ProtocolError(INVALID_REQUEST, f"invalid request: {e}", rid) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(PARSE_ERROR, f"parse error: {e}") from None


def error_response(id: Id, err: BaseException) -> bytes:
    if isinstance(err, ProtocolError):
        obj = ErrorObj(code=err.code, message=err.message, data=err.data or {"type": _std_type(err.code)})
    elif isinstance(err, ActordError):
        obj = ErrorObj(code=err.code, message=err.message, data=err.to_dict())
    else:
        obj = ErrorObj(code=INTERNAL_ERROR, message=f"internal error: {type(err).__name__}",
                       data={"type": "InternalError"})
    return encoder.encode(ErrorResponse(id=id, error=obj)) + b"\n"


def _std_type(code: int) -> str:
    return {
        PARSE_ERROR: "ParseError", INVALID_REQUEST: "InvalidRequest",
        METHOD_NOT_FOUND: "MethodNotFound", -32602: "InvalidParams",
    }.get(code, "InternalError")


def result_response(id: Id, result: Any) -> bytes:
    return encoder.encode(Response(id=id, result=result)) + b"\n"


def notification(method: str, params: Any) -> bytes:
    return encoder.encode(Notification(method=method, params=params)) + b"\n"
