"""One typed error, one HTTP status, on every API the front speaks (`responses.status_of`):
OpenAI's chat and text completions (and llama-server's unprefixed aliases of them), the
Responses API, Anthropic's Messages API and llama-server's /completion each shape their own
error body around the same status, so a client that retries on 503 or shortens on 400
does so whichever API it speaks.

The front is driven as an ASGI app (httpx's ASGITransport) over a service whose every
generation fails with the error under test: no model, no network."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from actord.engine.jobs import ModelProps
from actord.frontends.http.anthropic.stream import error_object as anthropic_error
from actord.frontends.http.app import HttpFront
from actord.frontends.http.native.base import error_object as native_error
from actord.frontends.http.openai.responses_api import ResponsesAnswer
from actord.frontends.http.responses import HttpError, error_object as openai_error, status_of
from actord.vocabulary import errors as E
from actord.vocabulary.config import Config
from actord.vocabulary.metrics import Metrics

pytestmark = pytest.mark.anyio

KEY = "status-key"
ERRORS = [cls("it failed") for cls in sorted(E.ERROR_TYPES.values(), key=lambda c: c.__name__)]


def test_every_api_shapes_its_own_body_around_one_status_per_error():
    for e in [*ERRORS, HttpError(413, "too large", "body_too_large")]:
        want = status_of(e)
        got = {"openai": openai_error(e)[0], "llama": openai_error(e, llama=True)[0],
               "responses": ResponsesAnswer.error_object(e)[0], "anthropic": anthropic_error(e)[0],
               "native": native_error(e)[0]}
        assert set(got.values()) == {want}, (type(e).__name__, got)
        assert anthropic_error(e)[1]["type"] == "error" and "code" in native_error(e)[1]["error"]
        assert "type" in openai_error(e)[1]["error"] and "param" in openai_error(e)[1]["error"]


def test_a_refused_file_name_is_400_and_an_overload_503_everywhere():
    assert status_of(E.PathRefused("../x")) == status_of(E.NotARegularFile("fifo")) == 400
    for cls in (E.NoFreeSlot, E.PageRamExceeded, E.DeviceBudgetExceeded, E.ShuttingDown, E.Overloaded,
                E.ContextFull):
        assert status_of(cls("busy")) == 503, cls
    assert status_of(E.PromptTooLong("long", n_prompt_tokens=9, n_ctx=8)) == 400
    assert status_of(E.ActordError("odd")) == 400 and status_of(E.Cancelled("gone")) == 499


class FailingService:
    """A service whose every generation raises `error` (what the routes stand behind)."""

    def __init__(self, config: Config, error: Exception) -> None:
        self.config, self.error, self.metrics, self.closing = config, error, Metrics(), False

    def model_props(self) -> ModelProps:
        return ModelProps(n_ctx=512, n_batch=64, n_seq_max=2, n_vocab=512, n_ctx_train=512, n_swa=0,
                          recurrent=False, hybrid=False, needs_checkpoints=False, bos=1, eos=2, desc="fake")

    def request_limits(self) -> Any:
        return self.config.request_limits()

    async def chat(self, request: Any, *, on_token: Any = None, n: int = 1) -> Any:
        raise self.error

    async def complete(self, request: Any, *, on_token: Any = None) -> Any:
        raise self.error

    async def complete_n(self, request: Any, n: int, *, on_token: Any = None) -> Any:
        raise self.error


ROUTES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/completion", {"prompt": "hi", "n_predict": 2}),
]


@pytest.mark.parametrize("error", [E.NoFreeSlot("busy"), E.ContextFull("full"), E.SlotBusy("busy"),
                                   E.PromptTooLong("long", n_prompt_tokens=900, n_ctx=512),
                                   E.PageDiskExceeded("disk"), E.InternalError("bug")],
                         ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_same_error_gets_the_same_status_on_every_front(error, stream):
    config = Config(model="/models/fake.gguf", api_key=KEY)
    front = HttpFront(FailingService(config, error), config)
    got = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front.app), base_url="http://front") as c:
        for path, body in ROUTES:
            r = await c.post(path, json={"model": "m", "stream": stream, **body},
                             headers={"authorization": f"Bearer {KEY}"})
            got[path] = r.status_code
            shape = r.json()
            if path == "/v1/messages":
                assert shape["type"] == "error" and shape["error"]["message"], shape  # Anthropic's own
            elif path == "/completion":
                assert shape["error"]["code"] == r.status_code, shape  # llama-server's own
            else:
                assert shape["error"]["message"] and "param" in shape["error"], shape  # OpenAI's own
    assert set(got.values()) == {status_of(error)}, got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_storage_failure_reaches_a_client_without_the_daemons_paths(stream):
    secret = "/srv/actord-secret-layout/pages/ada.page"
    error = E.StorageError(f"write {secret}: No space left on device (ENOSPC)", op="write", path=secret,
                           errno=28)
    config = Config(model="/models/fake.gguf", api_key=KEY)
    front = HttpFront(FailingService(config, error), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front.app), base_url="http://front") as c:
        for path, body in ROUTES:
            r = await c.post(path, json={"model": "m", "stream": stream, **body},
                             headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code == 500, (path, r.text)
            assert "actord-secret-layout" not in r.text and "ENOSPC" in r.text, (path, r.text)


def test_a_page_file_error_names_the_file_but_not_the_folder_and_a_refused_name_stays_the_clients():
    from actord.frontends.http.responses import for_client

    e = for_client(E.CorruptPageFile("page file /srv/pages/ada.page: truncated", file="/srv/pages/ada.page"))
    assert isinstance(e, E.CorruptPageFile) and e.message == "page file ada.page: truncated"
    assert e.data == {"file": "ada.page"}
    refused = E.PathRefused("page file name '/etc/passwd' refused: absolute", name="/etc/passwd")
    assert for_client(refused) is refused
    plain = E.InvalidParams("n_probs is 1/2 too many")
    assert for_client(plain) is plain
