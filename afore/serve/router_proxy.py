"""`afore route`: an HTTP front for ``afore serve --attn-workers A`` that routes by token cost.

Listens on ``--port``, forwards ``/v1/completions`` and ``/v1/chat/completions`` to ``--upstream``
(vLLM's OpenAI server behind ``afore serve``) with the header ``X-data-parallel-rank`` set to the
engine ``afore.serve.router.RequestRouter`` picks (vLLM then skips its own count balancing for
that request), and streams the reply back unchanged. Every other path is forwarded as is.

Prompt tokens are counted with the model's tokenizer (``--tokenizer``, default the upstream's
model directory when it is local) or, without one, as characters / 4. A streamed request's
outstanding cost drops by one token per chunk and is released when the reply ends; a
non-streamed one is released at its end.

``GET /afore/router`` returns the router's state (outstanding and routed tokens and requests per
engine) and the last decisions (request, engine, prompt tokens, expected decode, outstanding
tokens per engine before the choice).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import sys
import time

from afore.serve.router import ROUTING_POLICIES, RequestRouter

FORWARDED_HEADERS = ("content-type", "authorization", "accept")
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", default="http://127.0.0.1:8000", help="afore serve's API (vLLM's OpenAI server)")
    parser.add_argument("--engines", type=int, required=True, help="data-parallel attention engines behind it (afore serve --attn-workers)")
    parser.add_argument("--policy", default="token-cost", choices=ROUTING_POLICIES)
    parser.add_argument("--decode-estimate", type=int, default=128, help="expected decode tokens of a request without max_tokens (and the cap with it)")
    parser.add_argument("--tokenizer", default="", help="tokenizer directory for prompt token counts (default: characters / 4)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--log-decisions", type=int, default=1000, help="decisions kept for GET /afore/router")


class TokenCounter:
    """Prompt tokens of a request body (completions ``prompt`` or chat ``messages``)."""

    def __init__(self, tokenizer_path: str = "") -> None:
        self.tokenizer = None
        if tokenizer_path:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def count(self, body: dict) -> int:
        if "messages" in body:
            text = "\n".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list):
                if prompt and all(isinstance(t, int) for t in prompt):
                    return len(prompt)
                text = "\n".join(map(str, prompt))
            else:
                text = str(prompt)
        if self.tokenizer is not None:
            return len(self.tokenizer(text)["input_ids"])
        return max(1, len(text) // 4)


class RoutingProxy:
    def __init__(self, upstream: str, router: RequestRouter, counter: TokenCounter, keep: int = 1000) -> None:
        self.upstream, self.router, self.counter = upstream.rstrip("/"), router, counter
        self.decisions: collections.deque = collections.deque(maxlen=keep)
        self._ids = itertools.count()
        self.session = None

    async def handle(self, request):
        from aiohttp import ClientSession, ClientTimeout, web

        if self.session is None:
            self.session = ClientSession(timeout=ClientTimeout(total=None))
        if request.path == "/afore/router":
            return web.json_response({**self.router.snapshot(), "decisions": list(self.decisions)})
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        rid = None
        if request.method == "POST" and request.path in ROUTED_PATHS:
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                return web.json_response({"error": "body: expected JSON"}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"error": "body: expected a JSON object"}, status=400)
            prompt_tokens = self.counter.count(body)
            max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
            max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens >= 0 else None
            rid = f"r{next(self._ids)}"
            before = self.router.outstanding_tokens.tolist()
            engine = self.router.route(rid, prompt_tokens, max_tokens)
            headers["X-data-parallel-rank"] = str(engine)
            self.decisions.append({"request": rid, "engine": engine, "prompt_tokens": prompt_tokens,
                                   "expected_decode": self.router.requests[rid].expected_decode,
                                   "outstanding_tokens_before": before, "time": time.time()})
        try:
            async with self.session.request(request.method, self.upstream + request.path_qs, data=raw, headers=headers) as up:
                response = web.StreamResponse(status=up.status, headers={"content-type": up.headers.get("content-type", "application/json")})
                await response.prepare(request)
                prefilled = False
                async for chunk in up.content.iter_any():
                    await response.write(chunk)
                    if rid is not None:
                        if not prefilled:
                            self.router.progress(rid, self.router.requests[rid].prompt_tokens)
                            prefilled = True
                        self.router.progress(rid, chunk.count(b"data: "))
                await response.write_eof()
                return response
        finally:
            if rid is not None:
                self.router.finish(rid)


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    try:
        router = RequestRouter(args.engines, args.policy, args.decode_estimate)
        counter = TokenCounter(args.tokenizer)
    except (ValueError, OSError) as exc:
        print(f"afore route: {exc}", file=sys.stderr)
        return 2
    proxy = RoutingProxy(args.upstream, router, counter, args.log_decisions)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    print(f"afore route: {args.policy} over {args.engines} engines of {args.upstream}, on http://{args.host}:{args.port} "
          f"(state: GET /afore/router)", file=sys.stderr)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0
