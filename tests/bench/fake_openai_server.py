"""A tiny OpenAI-compatible streaming server for testing `afore bench serve` without vLLM.

/v1/completions streams ``max_tokens`` chunks: the first after ``--first-delay`` s, the
others ``--itl`` s apart, then a usage chunk and ``[DONE]``. A prompt containing ``FAIL``
gets HTTP 400; ``--policy broken`` exits at start. ``--policy-endpoint`` adds POST /afore/policy. GET /fake/stats reports what
the server saw (policies set, requests, the largest number in flight, ignore_eos and temperature
values); with ``--policy-endpoint``, GET /metrics has one afore counter (requests so far).
"""

import argparse
import asyncio
import json

from aiohttp import web


def make_app(args):
    stats = {"policies": [], "requests": 0, "max_in_flight": 0, "ignore_eos": [], "temperature": [],
             "launched_policy": args.policy}
    in_flight = 0

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def completions(request):
        nonlocal in_flight
        body = await request.json()
        if "FAIL" in body["prompt"]:
            return web.json_response({"error": {"message": "bad prompt", "code": 400}}, status=400)
        stats["requests"] += 1
        stats["ignore_eos"].append(body.get("ignore_eos"))
        stats["temperature"].append(body.get("temperature"))
        in_flight += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(args.first_delay)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(args.itl)
                # A prompt with HELD gets empty text on every step (as vLLM streams tokens that
                # end inside a UTF-8 character); the last step carries the finish reason.
                last = i == body["max_tokens"] - 1
                text = "" if "HELD" in body["prompt"] else f" t{i}"
                chunk = {"object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": text, "finish_reason": "length" if last else None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            closing = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}  # text-less close
            await resp.write(f"data: {json.dumps(closing)}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                              "completion_tokens": body["max_tokens"]}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        finally:
            in_flight -= 1

    async def policy(request):
        stats["policies"].append((await request.json())["policy"])
        return web.json_response({"policy": stats["policies"][-1]})

    async def metrics(request):  # afore serve's /metrics: one afore counter, one per request (policy endpoint only)
        return web.Response(text=f"# TYPE afore_ring_published_total counter\nafore_ring_published_total {stats['requests']}.0\n"
                                 "vllm:num_requests_running 0.0\n")

    async def fake_stats(request):
        return web.json_response(stats)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/fake/stats", fake_stats)
    if args.policy_endpoint:
        app.router.add_post("/afore/policy", policy)
        app.router.add_get("/metrics", metrics)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--policy", default=None)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--first-delay", type=float, default=0.03)
    parser.add_argument("--itl", type=float, default=0.005)
    parser.add_argument("--policy-endpoint", action="store_true")
    args = parser.parse_args()
    if args.policy == "broken":  # lets tests see a server that fails to start
        raise SystemExit(2)
    web.run_app(make_app(args), host=args.host, port=args.port, print=None)
