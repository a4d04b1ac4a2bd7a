"""The dev server the Temporal tests share answers a client on loopback."""

from __future__ import annotations

from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client

from on_temporal.conftest import DevServer


async def test_dev_server_answers_a_client(temporal_server: DevServer) -> None:
    client = await Client.connect(temporal_server.address)
    info = await client.workflow_service.get_system_info(GetSystemInfoRequest())
    assert info.server_version
