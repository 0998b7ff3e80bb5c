"""llama-server's /slots and their actions, with the seed's page verbs where the fork put
them.

Why a module of its own: these routes move a slot's state (save and restore to a file,
erase; the seed's page_out, page_in, page_drop and spill of a page), each answered in
llama-server's shape with actord's own fields beside it; nothing else of the native API
needs them.

Routes: `GET /slots` (`?fail_on_no_slot=1`: 503 unless a slot is idle; 501 with
`--no-http-slots`, llama-server's default), `POST
/slots/{id}?action=save|restore|erase` (`filename`, or `file`, in the body), and the
seed's `?action=page_out&page=NAME`, `page_in`, `page_drop`, `spill` (`filename`/`file`
and `drop` in the body). Each decodes the verb's typed arguments (actord/service/params.py:
a page name checked, a file name bounded) and calls the Service verb of the same job.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.service.slot_ctx import slot_n_ctx
from actord.vocabulary.errors import InvalidParams
from actord.service.params import PageParams, SlotFileParams, SlotPageParams, SlotParams, SpillParams
from actord.frontends.http.native.base import NativeRoutes
from actord.frontends.http.responses import HttpError, json_response


as_json = msgspec.to_builtins  # a verb's answer as the route's JSON (its Structs as objects)


class SlotRoutes(NativeRoutes):
    def routes(self) -> list[Route]:
        return [Route("/slots", self._guard(self.slots), methods=["GET"]),
                Route("/slots/{id_slot}", self._guard(self.slot_action), methods=["POST"])]

    async def slots(self, request: Request) -> Response:
        if not self.config.http_slots:  # llama-server without --slots
            raise HttpError(501, "This server does not support slots endpoint. Start it with `--http-slots`",
                            "not_supported")
        infos = await self.system.slot_list()
        n_ctx = slot_n_ctx(self.config, self.system.model_props().n_ctx)
        out = [{"id": i.id, "id_task": -1, "n_ctx": n_ctx, "speculative": False,
                "is_processing": i.state == "processing", **msgspec.to_builtins(i)} for i in infos]
        if request.query_params.get("fail_on_no_slot") and not any(i.state == "idle" for i in infos):
            raise HttpError(503, "no slot available", "unavailable")
        return json_response(out)

    async def slot_action(self, request: Request) -> Response:
        try:
            slot = int(request.path_params["id_slot"])
        except ValueError:
            raise InvalidParams("Invalid slot ID", param="id_slot") from None
        action = request.query_params.get("action", "")
        if action not in ("save", "restore", "erase", "page_out", "page_in", "page_drop", "spill"):
            raise InvalidParams(f"Invalid action {action[:64]!r}: one of save, restore, erase, page_out, "
                                "page_in, page_drop, spill", param="action")
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")

        def field(name: str, *, query: bool = False, alias: str | None = None) -> Any:
            vals = [v for v in ((obj.get(name) if name in obj else None),
                                (obj.get(alias) if alias and alias in obj else None),
                                (request.query_params.get(name) if query else None)) if v is not None]
            if not vals:
                raise InvalidParams(f'"{name}" is required for action={action}', param=name)
            if any(v != vals[0] for v in vals):
                raise InvalidParams(f'"{name}" is given twice, with different values', param=name)
            return vals[0]

        system = self.system
        if action == "erase":
            held = next((i.n_tokens for i in await system.slot_list() if i.id == slot), 0)
            await system.slot_erase(self._convert({"slot": slot}, SlotParams).slot)
            return json_response({"id_slot": slot, "n_erased": held, "erased": True})
        if action in ("save", "restore"):
            filename = field("filename", alias="file")
            f = self._convert({"slot": slot, "file": filename}, SlotFileParams)
            r = as_json(await (system.slot_save if action == "save" else system.slot_restore)(f.slot, f.file))
            if action == "save":
                shaped = {"n_saved": r["n_tokens"], "n_written": r["n_bytes"], "timings": {"save_ms": r["t_ms"]}}
            else:
                shaped = {"n_restored": r["n_tokens"], "n_read": r["n_bytes"], "timings": {"restore_ms": r["t_ms"]}}
            return json_response({"id_slot": slot, "filename": filename, **shaped, **r})
        page = field("page", query=True)
        if action in ("page_out", "page_in"):
            p = self._convert({"slot": slot, "page": page}, SlotPageParams)
            r = as_json(await (system.page_out if action == "page_out" else system.page_in)(p.slot, p.page))
            return json_response({"id_slot": slot, **r, "timings": {f"{action}_ms": r["t_ms"]}})
        if action == "page_drop":
            r = as_json(await system.page_drop(self._convert({"page": page}, PageParams).page))
            return json_response({"id_slot": slot, **r, "dropped": True})
        drop = obj.get("drop", request.query_params.get("drop", False))
        if isinstance(drop, str):
            drop = drop.lower() in ("1", "true", "yes")
        sp = self._convert({"page": page, "file": field("filename", alias="file"), "drop": drop}, SpillParams)
        r = as_json(await system.page_spill(sp.page, sp.file, sp.drop))
        return json_response({"id_slot": slot, "filename": r["file"], **r, "timings": {"spill_ms": r["t_ms"]}})
