"""`afore route` against a stand-in upstream: the engine header follows token-cost routing and the
load is released when replies end."""

from __future__ import annotations

import asyncio
import json

from afore.ports import free_port
from afore.serve.router import RequestRouter
from afore.serve.router_proxy import RoutingProxy, TokenCounter


async def _serve(app, port):
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_proxy_routes_by_token_cost_and_releases_load():
    from aiohttp import ClientSession, web

    seen = []

    async def upstream(request):
        body = await request.json()
        seen.append((int(request.headers["X-data-parallel-rank"]), len(body["prompt"]) // 4))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        if len(body["prompt"]) > 1000:  # the long request stays in flight until the short ones are answered
            await state_events["shorts_done"].wait()
        for _ in range(3):
            await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        return response

    state_events = {}

    async def main():
        state_events["shorts_done"] = asyncio.Event()
        up_port, proxy_port = free_port(), free_port()
        up_app = web.Application()
        up_app.router.add_post("/v1/completions", upstream)
        proxy = RoutingProxy(f"http://127.0.0.1:{up_port}", RequestRouter(2, "token-cost", decode_estimate=4), TokenCounter())
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", proxy.handle)
        runners = [await _serve(up_app, up_port), await _serve(app, proxy_port)]
        try:
            async with ClientSession() as session:
                async def send(chars):
                    body = {"model": "m", "prompt": "a" * chars, "max_tokens": 4, "stream": True}
                    async with session.post(f"http://127.0.0.1:{proxy_port}/v1/completions", json=body) as r:
                        assert r.status == 200
                        return await r.read()
                # one long prompt in flight, then short ones: they all go to the other engine
                long = asyncio.create_task(send(8000))
                while not seen:  # routed and at the upstream (no sleep that a loaded machine outlasts)
                    await asyncio.sleep(0.001)
                outs = await asyncio.gather(*(send(40) for _ in range(3)))
                state_events["shorts_done"].set()
                await long
                assert all(b"[DONE]" in o for o in outs)
                async with session.get(f"http://127.0.0.1:{proxy_port}/afore/router") as r:
                    state = await r.json()
        finally:
            for runner in runners:
                await runner.cleanup()
            await proxy.session.close()
        return state

    state = asyncio.run(main())
    long_engine = seen[0][0]
    assert all(engine != long_engine for engine, _ in seen[1:])
    assert state["outstanding_tokens"] == [0, 0] and state["outstanding_requests"] == [0, 0]
    assert state["routed_requests"][long_engine] == 1 and len(state["decisions"]) == 4
    assert state["decisions"][0]["prompt_tokens"] == 2000
