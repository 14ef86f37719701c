"""`POST /slots/{id}?action=save|restore|erase` (llama-server's, with --slot-save-path): the request
checked here, the action run on the engine thread once the slot is free (slot_actions.py).
Errors in llama-server's words: 501 without --slot-save-path, 400 for a bad id, action or name."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..files.slot_file import SlotFileError, slot_path
from .chat import ClientGone, one_event, read_body
from .protocol import ApiError
from .slot_actions import ACTIONS, SlotAction
from .worker import SlotDone


def _filename(raw: bytes) -> str:
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, '"filename" must be provided as a string', param="filename")
    return name


async def slot_action(request: Request) -> Response:
    st = request.app.state.spark
    if st.slot_save_path is None:
        raise ApiError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                       "not_supported_error")
    try:
        id_slot = int(request.path_params["id_slot"])
    except ValueError:
        raise ApiError(400, "Invalid slot ID", param="id_slot") from None
    kind = request.query_params.get("action", "")
    if kind not in ACTIONS:
        raise ApiError(400, "Invalid action", param="action")
    try:
        raw = await read_body(request, st.max_body)
    except ClientGone:
        return Response(status_code=499)
    action = SlotAction(kind)
    if kind != "erase":
        name = _filename(raw)
        try:
            slot_path(st.slot_save_path, name)
        except SlotFileError as e:
            raise ApiError(400, e.message, param="filename") from None
        action = SlotAction(kind, st.slot_save_path, name, st.model_id)
    try:
        ev = await one_event(request, st.worker, id_slot=id_slot, slot_action=action)
    except ClientGone:
        return Response(status_code=499)
    assert isinstance(ev, SlotDone)
    return JSONResponse(ev.body)


ROUTES = [Route("/slots/{id_slot}", slot_action, methods=["POST"])]
